"""Trainer throughput on one GPU: the primejax RL/SFT step vs a plain torch + transformers step, side by side.

    python tools/bench_trainer.py                      # checks, then every configuration, then the table
    python tools/bench_trainer.py --suite explore      # remat / chunk / kernel variants at 16k and 64k
    python tools/bench_trainer.py --only jax:16384:rl  # one configuration (see CONFIGS for the names)

Each configuration runs in its own process (clean peak-memory counters, an OOM stays contained), does
`--warmup` steps (the first one compiles) and then `--steps` timed steps that are dispatched back to back and
synchronized once at the end. Model: Qwen3-0.6B shape, random init. Fake data: full rows of random tokens, one
sample per row, loss over every token. Throughput counts every token; MFU uses prime-rl's formula
(`ModelConfig.flops_per_token`) over a 989 TFLOP/s bf16 peak.

The torch baseline is the naive trainer step the issue describes: transformers Qwen3ForCausalLM (sdpa), bf16
parameters, full fp32 logits, mean cross-entropy, grad-norm clip, torch AdamW; with and without gradient
checkpointing. Results (one JSON object per configuration) go to `--out` as they arrive, the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (`python tools/bench_trainer.py`): the repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.bench_trainer_checks import check_worker  # noqa: E402
from tools.bench_trainer_profile import (  # noqa: E402
    _jax_parts,
    _jax_peak_gib,
    _memory_analysis,
    _timed,
    _trace_summary,
)
from tools.model_shapes import QWEN3  # noqa: E402

PEAK_FLOPS = 989e12
QWEN3_06B = dict(QWEN3["qwen3-0.6b"], max_position_embeddings=65536)  # rows up to 64k
GIB = 2.0**30


# ----------------------------------------------------------------------------------------------- configurations


def _jax(
    seq,
    rows=1,
    loss="rl",
    remat="auto",
    attn="cudnn",
    chunk=2048,
    steps=5,
    warmup=2,
    profile=False,
    trace=False,
    head="default",
    tag="",
    segs=1,
    patch=(),
    xla_flags="",
    scan=None,
    hlo=False,
    save_gib=None,
):
    """segs: the step's static bound on samples per row (the fake rows hold one); 0 = unknown, i.e. the
    attention kernel's default of 64 run slots (the behaviour before the bound was passed down).
    patch: names from PATCHES (earlier code paths, for before/after in one run); xla_flags: added to
    XLA_FLAGS for this configuration's process; scan: ModelConfig.scan_layers (None: its default); hlo: save
    the optimized HLO to $BENCH_TRACE_DIR; save_gib: the trainer's `lm_head_saved_logits_gib` (None: its
    default, auto; 0: the head always recomputes its logits, the step before they could be kept)."""
    name = f"jax:{seq}:{loss}" + ("" if rows == 1 else f":x{rows}") + (f":{tag}" if tag else "")
    return dict(
        kind="jax",
        name=name,
        seq=seq,
        rows=rows,
        loss=loss,
        remat=remat,
        attn=attn,
        chunk=chunk,
        steps=steps,
        warmup=warmup,
        profile=profile,
        trace=trace,
        head=head,
        segs=segs,
        patch=list(patch),
        xla_flags=xla_flags,
        scan=scan,
        hlo=hlo,
        save_gib=save_gib,
    )


def _torch(seq, rows=1, ckpt=True, steps=4, warmup=2):
    return dict(
        kind="torch",
        name=f"torch:{seq}:{'ckpt' if ckpt else 'nockpt'}" + ("" if rows == 1 else f":x{rows}"),
        seq=seq,
        rows=rows,
        ckpt=ckpt,
        loss="ce",
        steps=steps,
        warmup=warmup,
    )


# The code paths before explore4 (commit 858e44c); with scan=True, that commit's step.
_OLD = ("packed_one_sample", "head_three_pass")
_FLAGS = {
    "lhs": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "nocmdbuf": "--xla_gpu_enable_command_buffer=",
    "notriton": "--xla_gpu_enable_triton_gemm=false",
    "cublaslt": "--xla_gpu_enable_cublaslt=true",
    "dbuf": "--xla_gpu_enable_while_loop_double_buffering=true",
}

CONFIGS = {
    "explore4": [
        dict(kind="check", name="check"),
        _jax(16384, patch=_OLD, scan=True, trace=True, hlo=True, tag="old"),
        _jax(16384, scan=True, trace=True, tag="new"),
        _jax(16384, patch=("packed_one_sample",), scan=True, tag="new_packed"),
        _jax(16384, patch=("head_three_pass",), scan=True, tag="new_head3"),
        _jax(16384, scan=False, trace=True, hlo=True, tag="unroll"),
        _jax(32768, scan=True, tag="new"),
        _jax(32768, scan=False, tag="unroll"),
        _jax(65536, steps=2, scan=True, tag="new"),
        _jax(65536, steps=2, scan=False, tag="unroll"),
        *[_jax(16384, xla_flags=f, scan=True, tag=k) for k, f in _FLAGS.items()],
        _jax(32768, patch=_OLD, scan=True, tag="old"),
        _jax(4096, rows=4, tag="new"),
        _jax(8192, rows=2, loss="ce", tag="new"),
    ],
    # The table of docs/benchmarks.md. "before": the step of 97003a3 (the head recomputes its logits in the
    # backward at every size), same process setup, same run.
    "main": [
        dict(kind="check", name="check"),
        _jax(16384, trace=True),
        _jax(16384, save_gib=0, tag="before"),
        _torch(16384, ckpt=True),
        _torch(16384, ckpt=False),
        _jax(32768),
        _torch(32768, ckpt=True),
        _torch(32768, ckpt=False),
        _jax(65536, steps=2, trace=True),
        _torch(65536, ckpt=True),
        _jax(4096, rows=4),
        _torch(4096, rows=4, ckpt=False),
        _jax(8192, rows=2, loss="ce"),
        _jax(8192, rows=2, loss="ce", save_gib=0, tag="before"),
        _torch(8192, rows=2, ckpt=True),
        _torch(8192, rows=2, ckpt=False),
        _jax(32768, save_gib=40, tag="saved"),  # beyond auto's share: what keeping the logits buys at 32k
    ],
    # Exploration after the segment bound reached the kernel: before/after at 16k, remat choices at 16k and
    # 64k (memory: does 64k fit an 80 GB card), the attention kernel sweep (cuDNN modes, Pallas Triton).
    "explore3": [
        dict(kind="check", name="check", kernels=True),
        _jax(16384, remat="dots_no_batch_attn", trace=True, tag="dnba"),
        _jax(16384, remat="dots_no_batch_attn", segs=0, tag="dnba_64slots"),
        _jax(16384, remat="none", tag="none"),
        _jax(16384, remat="attn", tag="attn"),
        _jax(32768, remat="dots_no_batch_attn", tag="dnba"),
        _jax(65536, remat="attn", steps=2, trace=True, tag="attn"),
        _jax(65536, remat="dots_no_batch_attn", steps=2, tag="dnba"),
        _jax(65536, remat="attn", steps=2, chunk=1024, tag="attn_c1024"),
        _torch(16384, ckpt=False),
        _torch(32768, ckpt=True),
    ],
    "explore2": [
        dict(kind="check", name="check"),
        _jax(16384, remat="none", trace=True, tag="base"),
        _jax(16384, remat="none", head="fused", trace=True, tag="fused"),
        _jax(16384, remat="dots_no_batch_attn", head="fused", tag="dnba"),
        _jax(16384, remat="attn", head="fused", tag="attn"),
        _jax(32768, remat="dots_no_batch_attn", head="fused", tag="dnba"),
        _jax(65536, remat="attn", head="fused", steps=2, trace=True, tag="attn"),
        _jax(65536, remat="dots_no_batch_attn", head="fused", steps=2, tag="dnba"),
        _torch(32768, ckpt=True),
        _torch(32768, ckpt=False),
        _torch(65536, ckpt=True),
    ],
    "explore": [
        dict(kind="check", name="check", kernels=True),
        _jax(16384, remat="none", profile=True),
        _jax(16384, remat="dots_no_batch"),
        _jax(16384, remat="full"),
        _jax(16384, remat="none", chunk=8192),
        _jax(65536, remat="full", steps=2, profile=True),
        _torch(16384, ckpt=True),
        _torch(16384, ckpt=False),
    ],
}


# ----------------------------------------------------------------------------------------------- jax worker


def _model_config(attn: str, remat: str, scan: bool | None = None):
    from primejax.models.config import ModelConfig

    extra = {} if scan is None else {"scan_layers": scan}
    return ModelConfig.from_hf_config(
        QWEN3_06B,
        param_dtype="float32",
        compute_dtype="bfloat16",
        attention_impl=attn,
        remat_policy=remat,
        **extra,
    )


def _patch_packed_one_sample() -> None:
    """Rows of one sample through cuDNN's packed mode (2 run slots), as before the plain causal path."""
    from primejax.models import attention as at
    from primejax.models import transformer as tr

    def prepare(segment_ids, *, impl, dtype, max_segments=None):
        if at.resolve_impl(impl, dtype) != "cudnn":
            return None
        return at.segment_runs(segment_ids, at.runs_for_segments(max_segments))

    tr.prepare_segments = prepare


def _patch_head_three_pass() -> None:
    """The LM head's forward statistics as before: lse, then sum(p z) in a third read of the logits."""
    import jax
    import jax.numpy as jnp

    from primejax.trainer import fused_head

    def stats(z):
        lse = jax.nn.logsumexp(z, axis=-1)
        return lse, lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)

    fused_head._lse_and_entropy = stats


PATCHES = {"packed_one_sample": _patch_packed_one_sample, "head_three_pass": _patch_head_three_pass}


def _fake_batch(rows: int, seq: int, vocab: int, loss: str, seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(k[0], (rows, seq), 0, vocab, dtype=jnp.int32)
    ones = jnp.ones((rows, seq), jnp.float32)
    zeros = jnp.zeros((rows, seq), jnp.float32)
    rl = loss == "rl"
    return {
        "tokens": tokens,
        "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)),
        "segment_ids": jnp.ones((rows, seq), jnp.int32),
        "targets": jnp.roll(tokens, -1, axis=1),
        "temperatures": ones,
        "loss_mask": jnp.ones((rows, seq), bool),
        "inference_logprobs": -jax.random.uniform(k[1], (rows, seq), minval=0.0, maxval=12.0),
        "ref_logprobs": zeros,
        "advantages": jax.random.normal(k[2], (rows, seq)),
        "rl_weights": ones if rl else zeros,
        "ce_weights": zeros if rl else ones,
        "ref_kl_weights": zeros,
    }


def jax_worker(c: dict) -> dict:
    """The trainer's own jitted step (primejax.trainer.step) on one device, fake rows, timed."""
    import jax
    import numpy as np
    import optax

    from primejax.models.sharding import init_model, make_mesh
    from primejax.models.transformer import resolve_remat_policy
    from primejax.trainer import optim
    from primejax.trainer import step as step_mod
    from primejax.trainer.fused_head import saved_logits_bytes
    from primejax.trainer.logprobs import saved_logits_max_bytes
    from primejax.trainer.losses import LossConfig

    if c.get("head") == "fused":  # exploration only: the fused head before it became the default
        from primejax.trainer.fused_head import fused_token_logprobs

        step_mod.token_logprobs = fused_token_logprobs
    for name in c.get("patch", ()):
        PATCHES[name]()
    cfg = _model_config(c["attn"], c["remat"], c.get("scan"))
    rows, seq = c["rows"], c["seq"]
    mesh = make_mesh()
    with jax.set_mesh(mesh):
        model = init_model(cfg, mesh, seed=0)
        opt = optim.make_optimizer(
            dict(lr=1e-6, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, max_norm=1.0),
            optax.constant_schedule(1e-6),
        )
        from flax import nnx

        graphdef = nnx.graphdef(model)
        state = step_mod.init_state(model, opt)
        del model
        # The trainer's setting: -1 = auto (a share of this device's memory), as `lm_head_saved_logits_gib`.
        save_bytes = saved_logits_max_bytes(-1 if c.get("save_gib") is None else c["save_gib"])
        fn = step_mod.make_train_step(
            graphdef,
            opt,
            optax.constant_schedule(1e-6),
            LossConfig(),
            chunk_size=c["chunk"],
            max_segments=c.get("segs", 1),
            saved_logits_max_bytes=save_bytes,
        )
        host = {
            k: np.asarray(v)[None]
            for k, v in _fake_batch(rows, seq, cfg.vocab_size, c["loss"]).items()
            if k != "targets"
        }
        batch = step_mod.device_batch(host, mesh)
        t0 = time.perf_counter()
        step = step_mod.jit_train_step(fn, state, mesh).lower(state, batch).compile()
        compile_only_s = time.perf_counter() - t0
        mem = _memory_analysis(step)
        if c.get("hlo") and os.environ.get("BENCH_TRACE_DIR"):
            import gzip

            path = Path(os.environ["BENCH_TRACE_DIR"]) / f"hlo_{c['name'].replace(':', '_')}.txt.gz"
            path.write_bytes(gzip.compress(step.as_text().encode()))
        box = {"s": state}

        def run(batch):
            box["s"], metrics = step(box["s"], batch)
            return metrics["loss"]

        first, dt = _timed(run, lambda: (batch,), c["steps"], c["warmup"])
        loss = float(run(batch))
        tokens = rows * seq
        res = dict(
            tok_s=tokens / dt,
            step_ms=dt * 1e3,
            compile_s=compile_only_s,
            first_step_s=first,
            loss=loss,
            mfu=tokens * cfg.flops_per_token(seq) / dt / PEAK_FLOPS,
            peak_gib=_jax_peak_gib(),
            memory=mem,
            remat_resolved=resolve_remat_policy(c["remat"], rows * seq),
            head_saves_logits=0 < saved_logits_bytes(rows * seq, cfg.vocab_size, "bfloat16") <= save_bytes,
        )
        if c.get("trace"):
            res["trace"] = _trace_summary(run, batch)
        if c.get("profile"):
            res["parts"] = _jax_parts(
                cfg,
                graphdef,
                box["s"].params,
                _fake_batch(rows, seq, cfg.vocab_size, c["loss"]),
                c["chunk"],
                opt,
                box["s"].opt_state,
            )
    return res


# ----------------------------------------------------------------------------------------------- torch worker


def torch_worker(c: dict) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    hf = dict(QWEN3_06B)
    hf.pop("model_type")
    cfg = transformers.Qwen3Config(**hf, attn_implementation="sdpa", use_cache=False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke tests of this script only
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    peak = (lambda: torch.cuda.max_memory_allocated() / GIB) if dev == "cuda" else (lambda: 0.0)
    with torch.device(dev):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    if c["ckpt"]:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    rows, seq = c["rows"], c["seq"]
    x = torch.randint(0, cfg.vocab_size, (rows, seq), device=dev)
    y = torch.roll(x, -1, dims=1)

    def step():
        logits = model(input_ids=x).logits.float()  # the naive step: full fp32 [B, T, V] logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    try:
        t0 = time.perf_counter()
        for _ in range(c["warmup"]):
            step()
        sync()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(c["steps"]):
            loss = step()
        sync()
        dt = (time.perf_counter() - t0) / c["steps"]
    except torch.cuda.OutOfMemoryError:
        return dict(oom=True, peak_gib=peak())
    tokens = rows * seq
    from primejax.models.config import ModelConfig

    fpt = ModelConfig.from_hf_config(QWEN3_06B).flops_per_token(seq)
    return dict(
        tok_s=tokens / dt,
        step_ms=dt * 1e3,
        compile_s=first,
        loss=float(loss),
        mfu=tokens * fpt / dt / PEAK_FLOPS,
        peak_gib=peak(),
    )


# ----------------------------------------------------------------------------------------------- driver

WORKERS = {"jax": jax_worker, "torch": torch_worker, "check": check_worker}


def _run_child(c: dict, timeout: float) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.94", PYTHONUNBUFFERED="1")
    if c.get("xla_flags"):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + c["xla_flags"]).strip()
    cmd = [sys.executable, __file__, "--worker", json.dumps(c)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(c, error=f"timeout after {timeout:.0f}s")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        tail = (p.stderr or p.stdout)[-1500:]
        oom = "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail.lower()
        return dict(c, oom=oom, error=None if oom else tail, wall_s=time.perf_counter() - t0)
    return dict(c, **json.loads(lines[-1][7:]), wall_s=time.perf_counter() - t0)


def _table(results: list[dict]) -> str:
    torch_best = {}
    for r in results:
        if r["kind"] == "torch" and r.get("tok_s"):
            key = (r["seq"], r["rows"])
            torch_best[key] = max(torch_best.get(key, 0.0), r["tok_s"])
    head = f"{'impl':<24}{'seq':>7}{'rows':>5}{'tok/s':>10}{'MFU':>7}{'step ms':>10}{'peak GiB':>10}{'vs torch':>9}  notes"
    lines = [head, "-" * len(head)]
    for r in results:
        if r["kind"] == "check":
            continue
        label = ""
        if r["kind"] == "jax":
            remat = r.get("remat_resolved") or r["remat"]
            label = f"remat={remat} attn={r['attn']} segs={r.get('segs', 1)} chunk={r['chunk']}"
            label += " scan" if r.get("scan") else ""
            label += " head=saved" if r.get("head_saves_logits") else " head=recompute"
            if r.get("memory", {}).get("temp") is not None:
                label += f" temp={r['memory']['temp']:.1f}G"
        if r.get("tok_s"):
            best = torch_best.get((r["seq"], r["rows"]))
            ratio = f"{r['tok_s'] / best:.2f}x" if best and r["kind"] == "jax" else ""
            lines.append(
                f"{r['name']:<24}{r['seq']:>7}{r['rows']:>5}{r['tok_s']:>10.0f}{100 * r['mfu']:>6.1f}%"
                f"{r['step_ms']:>10.1f}{r['peak_gib']:>10.1f}{ratio:>9}  {label}"
            )
        else:
            status = "OOM" if r.get("oom") else "FAIL"
            lines.append(f"{r['name']:<24}{r['seq']:>7}{r['rows']:>5}{status:>10}{'':>27}{'':>9}  {label}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="main", choices=sorted(CONFIGS))
    ap.add_argument("--only", default="", help="comma-separated configuration names from the suite")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    ap.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="seconds for the whole suite (0 = none): configurations that would start later are skipped",
    )
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        c = json.loads(args.worker)
        print("RESULT " + json.dumps(WORKERS[c["kind"]](c)), flush=True)
        return
    configs = CONFIGS[args.suite]
    if args.only:
        wanted = set(args.only.split(","))
        configs = [c for c in configs if c["name"] in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    start = time.perf_counter()
    for c in configs:
        left = args.budget - (time.perf_counter() - start) if args.budget else args.timeout
        if left < 20:
            results.append(dict(c, error="skipped: suite budget spent"))
            continue
        r = _run_child(c, min(args.timeout, left))
        results.append(r)
        print(json.dumps(r), flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    print()
    print(_table(results))


if __name__ == "__main__":
    main()
