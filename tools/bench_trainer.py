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

PEAK_FLOPS = 989e12
QWEN3_06B = dict(
    model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1e6,
    rms_norm_eps=1e-6, max_position_embeddings=65536,
)
GIB = 2.0**30


# ----------------------------------------------------------------------------------------------- configurations

def _jax(seq, rows=1, loss="rl", remat="auto", attn="cudnn", chunk=2048, steps=5, warmup=2, profile=False,
         trace=False, head="default", tag="", segs=1, patch=(), xla_flags="", scan=None, hlo=False, save_gib=None):
    """segs: the step's static bound on samples per row (the fake rows hold one); 0 = unknown, i.e. the
    attention kernel's default of 64 run slots (the behaviour before the bound was passed down).
    patch: names from PATCHES (earlier code paths, for before/after in one run); xla_flags: added to
    XLA_FLAGS for this configuration's process; scan: ModelConfig.scan_layers (None: its default); hlo: save
    the optimized HLO to $BENCH_TRACE_DIR; save_gib: the trainer's `lm_head_saved_logits_gib` (None: its
    default, auto; 0: the head always recomputes its logits, the step before they could be kept)."""
    name = f"jax:{seq}:{loss}" + ("" if rows == 1 else f":x{rows}") + (f":{tag}" if tag else "")
    return dict(kind="jax", name=name, seq=seq, rows=rows, loss=loss, remat=remat, attn=attn, chunk=chunk,
                steps=steps, warmup=warmup, profile=profile, trace=trace, head=head, segs=segs, patch=list(patch),
                xla_flags=xla_flags, scan=scan, hlo=hlo, save_gib=save_gib)


def _torch(seq, rows=1, ckpt=True, steps=4, warmup=2):
    return dict(kind="torch", name=f"torch:{seq}:{'ckpt' if ckpt else 'nockpt'}" + ("" if rows == 1 else f":x{rows}"),
                seq=seq, rows=rows, ckpt=ckpt, loss="ce", steps=steps, warmup=warmup)


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
        _torch(16384, ckpt=True), _torch(16384, ckpt=False),
        _jax(32768),
        _torch(32768, ckpt=True), _torch(32768, ckpt=False),
        _jax(65536, steps=2, trace=True),
        _torch(65536, ckpt=True),
        _jax(4096, rows=4),
        _torch(4096, rows=4, ckpt=False),
        _jax(8192, rows=2, loss="ce"),
        _jax(8192, rows=2, loss="ce", save_gib=0, tag="before"),
        _torch(8192, rows=2, ckpt=True), _torch(8192, rows=2, ckpt=False),
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
        _torch(16384, ckpt=False), _torch(32768, ckpt=True),
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
        _torch(32768, ckpt=True), _torch(32768, ckpt=False), _torch(65536, ckpt=True),
    ],
    "explore": [
        dict(kind="check", name="check", kernels=True),
        _jax(16384, remat="none", profile=True),
        _jax(16384, remat="dots_no_batch"),
        _jax(16384, remat="full"),
        _jax(16384, remat="none", chunk=8192),
        _jax(65536, remat="full", steps=2, profile=True),
        _torch(16384, ckpt=True), _torch(16384, ckpt=False),
    ],
}


# ----------------------------------------------------------------------------------------------- jax worker

def _model_config(attn: str, remat: str, scan: bool | None = None):
    from primejax.models.config import ModelConfig

    extra = {} if scan is None else {"scan_layers": scan}
    return ModelConfig.from_hf_config(QWEN3_06B, param_dtype="float32", compute_dtype="bfloat16",
                                      attention_impl=attn, remat_policy=remat, **extra)


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


def _timed(fn, args_fn, steps: int, warmup: int) -> tuple[float, float]:
    """(first-call seconds incl. compile, median-free mean seconds per call over `steps` back-to-back calls)."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args_fn()))
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        jax.block_until_ready(fn(*args_fn()))
    t0 = time.perf_counter()
    out = None
    for _ in range(steps):
        out = fn(*args_fn())
    jax.block_until_ready(out)
    return first, (time.perf_counter() - t0) / steps


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
        opt = optim.make_optimizer(dict(lr=1e-6, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, max_norm=1.0),
                                   optax.constant_schedule(1e-6))
        from flax import nnx

        graphdef = nnx.graphdef(model)
        state = step_mod.init_state(model, opt)
        del model
        # The trainer's setting: -1 = auto (a share of this device's memory), as `lm_head_saved_logits_gib`.
        save_bytes = saved_logits_max_bytes(-1 if c.get("save_gib") is None else c["save_gib"])
        fn = step_mod.make_train_step(graphdef, opt, optax.constant_schedule(1e-6), LossConfig(),
                                      chunk_size=c["chunk"], max_segments=c.get("segs", 1),
                                      saved_logits_max_bytes=save_bytes)
        host = {k: np.asarray(v)[None] for k, v in _fake_batch(rows, seq, cfg.vocab_size, c["loss"]).items()
                if k != "targets"}
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
        res = dict(tok_s=tokens / dt, step_ms=dt * 1e3, compile_s=compile_only_s, first_step_s=first, loss=loss,
                   mfu=tokens * cfg.flops_per_token(seq) / dt / PEAK_FLOPS, peak_gib=_jax_peak_gib(), memory=mem,
                   remat_resolved=resolve_remat_policy(c["remat"], rows * seq),
                   head_saves_logits=0 < saved_logits_bytes(rows * seq, cfg.vocab_size, "bfloat16") <= save_bytes)
        if c.get("trace"):
            res["trace"] = _trace_summary(run, batch)
        if c.get("profile"):
            res["parts"] = _jax_parts(cfg, graphdef, box["s"].params, _fake_batch(rows, seq, cfg.vocab_size, c["loss"]),
                                      c["chunk"], opt, box["s"].opt_state)
    return res


def _trace_summary(run, batch, steps: int = 2, top: int = 60) -> dict:
    """GPU time per step from a jax.profiler trace: by category and the top kernels / XLA ops."""
    import collections
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        out = None
        for _ in range(steps):
            out = run(batch)
        jax.block_until_ready(out)
    pb = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
    kernels: dict[str, float] = collections.defaultdict(float)
    ops: dict[str, float] = collections.defaultdict(float)
    lines_seen = []
    for plane in ProfileData.from_file(pb).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            lines_seen.append(line.name)
            target = ops if line.name == "XLA Ops" else kernels if line.name.startswith("Stream") else None
            if target is None:
                continue
            for ev in line.events:
                target[ev.name] += ev.duration_ns / 1e6 / steps

    def cat(name: str) -> str:
        n = name.lower()
        if any(x in n for x in ("fmha", "sdpa", "flash", "cudnn", "fprop", "dgrad")):
            return "attention"
        if any(x in n for x in ("gemm", "xmma", "cutlass", "cublas", "matmul", "gmma", "nvjet")):
            return "matmul"
        if any(x in n for x in ("reduce", "fusion", "loop", "copy", "transpose", "convert", "scatter", "gather")):
            return "fusion/elementwise"
        return "other"

    cats: dict[str, float] = collections.defaultdict(float)
    for k, v in kernels.items():
        cats[cat(k)] += v
    best = lambda d: dict(sorted(((k[:140], round(v, 2)) for k, v in d.items()), key=lambda x: -x[1])[:top])  # noqa: E731
    return dict(ms_per_step_by_category={k: round(v, 1) for k, v in cats.items()},
                kernel_ms_total=round(sum(kernels.values()), 1), top_kernels=best(kernels), top_xla_ops=best(ops),
                lines=sorted(set(lines_seen))[:20])


def _memory_analysis(compiled) -> dict:
    """XLA's buffer assignment for the compiled step, GiB: what the peak is made of."""
    try:
        m = compiled.memory_analysis()
        names = ("argument", "output", "alias", "temp", "generated_code")
        return {n: round(getattr(m, f"{n}_size_in_bytes") / GIB, 2) for n in names}
    except Exception as e:  # noqa: BLE001 - informational only
        return {"error": repr(e)[:200]}


def _jax_peak_gib() -> float:
    import jax

    stats = jax.devices()[0].memory_stats() or {}  # None on CPU
    return stats.get("peak_bytes_in_use", 0) / GIB


def _jax_parts(cfg, graphdef, params, batch, chunk, opt, opt_state) -> dict:
    """Per-part step time (ms): each part jitted and timed alone, fwd+bwd where it has a backward."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from primejax.models.attention import attention
    from primejax.trainer import losses
    from primejax.trainer import step as step_mod

    token_logprobs = step_mod.token_logprobs  # whichever head the step uses
    loss_fn = losses.make_loss_fn(losses.LossConfig())
    rows, seq = batch["tokens"].shape
    parts = {}
    model = nnx.merge(graphdef, params)
    h = jax.jit(lambda p: nnx.merge(graphdef, p)(batch["tokens"], batch["positions"], batch["segment_ids"]))(params)
    w = model.lm_head_weight()
    cot = jax.random.normal(jax.random.key(1), h.shape, jnp.bfloat16)

    def body_loss(p):  # the decoder stack with a linear stand-in for the head
        hh = nnx.merge(graphdef, p)(batch["tokens"], batch["positions"], batch["segment_ids"])
        return jnp.sum((hh * cot).astype(jnp.float32))

    f = jax.jit(jax.grad(body_loss))
    parts["decoder_fwd_bwd"] = _timed(f, lambda: (params,), 3, 1)[1] * 1e3

    def head_loss(h, w):
        lp, ent = token_logprobs(h, w, batch["targets"], batch["temperatures"], chunk)
        return loss_fn(lp, ent, batch, losses.global_counts(batch))[0]

    f = jax.jit(jax.grad(head_loss, argnums=(0, 1)))
    parts["lm_head_loss_fwd_bwd"] = _timed(f, lambda: (h, w), 3, 1)[1] * 1e3

    k = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(k[0], (rows, seq, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    kk = jax.random.normal(k[1], (rows, seq, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    v = jax.random.normal(k[2], (rows, seq, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)

    def attn_loss(q, kk, v):
        o = attention(q, kk, v, batch["segment_ids"], impl=cfg.attention_impl)
        return jnp.sum((o * q).astype(jnp.float32))

    f = jax.jit(jax.grad(attn_loss, argnums=(0, 1, 2)))
    one = _timed(f, lambda: (q, kk, v), 3, 1)[1]
    parts["attention_fwd_bwd_x_layers"] = one * cfg.num_layers * 1e3
    parts["attention_tflops"] = _attn_flops(rows, seq, cfg) * 3.5 / one / 1e12
    grads = jax.tree.map(jnp.ones_like, params)
    f = jax.jit(lambda g, s, p: optax.apply_updates(p, opt.update(g, s, p)[0]))
    parts["optimizer"] = _timed(f, lambda: (grads, opt_state, params), 3, 1)[1] * 1e3
    return parts


def _attn_flops(rows, seq, cfg) -> float:
    """Causal attention forward FLOPs (two matmuls over the lower triangle)."""
    return 2 * 2 * rows * seq * seq / 2 * cfg.num_heads * cfg.head_dim


# ----------------------------------------------------------------------------------------------- checks

def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_worker(c: dict) -> dict:
    """Every GPU fast path against its XLA reference: forward values and gradients, bf16 tolerance."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from primejax.models.attention import attention, prepare_segments
    from primejax.trainer.fused_head import fused_token_logprobs
    from primejax.trainer.logprobs import token_logprobs, token_logprobs_reference

    out: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    try:
        from jax._src import cuda_versions

        out["cudnn"] = cuda_versions.cudnn_get_version()
    except Exception as e:  # noqa: BLE001 - informational only
        out["cudnn"] = repr(e)
    tol = 2e-2
    # Attention on packed rows: several segments of uneven length plus trailing padding, GQA 16/8, Dh 128.
    t = 4096
    seg = np.zeros((2, t), np.int32)
    for r, lens in enumerate([(300, 1700, 1000, 1000), (4000,)]):
        pos = 0
        for s, n in enumerate(lens, 1):
            seg[r, pos:pos + n] = s
            pos += n
    seg = jnp.asarray(seg)
    k = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(k[0], (2, t, 16, 128), jnp.bfloat16)
    kk = jax.random.normal(k[1], (2, t, 8, 128), jnp.bfloat16)
    v = jax.random.normal(k[2], (2, t, 8, 128), jnp.bfloat16)
    cot = jax.random.normal(k[3], q.shape, jnp.bfloat16)

    def fwd_bwd(impl):
        def f(q, kk, v):
            return jnp.sum((attention(q, kk, v, seg, impl=impl) * cot).astype(jnp.float32))

        o = jax.jit(lambda q, kk, v: attention(q, kk, v, seg, impl=impl))(q, kk, v)
        return o, jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, kk, v)

    o_ref, g_ref = fwd_bwd("xla")
    o_fast, g_fast = fwd_bwd("cudnn")
    errs = {"attn_out": _rel(o_fast, o_ref)}
    errs.update({f"attn_d{n}": _rel(a, b) for n, a, b in zip("qkv", g_fast, g_ref, strict=True)})
    # As the model runs it: the runs described once, with the step's bound (4 samples -> 5 run slots).
    runs = prepare_segments(seg, impl="cudnn", dtype=q.dtype, max_segments=4)
    o_runs = jax.jit(lambda q, kk, v: attention(q, kk, v, seg, impl="cudnn", runs=runs))(q, kk, v)
    errs["attn_out_bound4"] = _rel(o_runs, o_ref)
    tight = prepare_segments(seg, impl="cudnn", dtype=q.dtype, max_segments=2)  # row 0 has 4: must flag
    out["overflow_flagged"] = [bool(x) for x in np.asarray(tight.overflow)]
    # One sample per row, padding last: the plain causal kernel, compared on the sample's tokens (values
    # and gradients; the padding gets no cotangent, as in the trainer where it carries no loss).
    seg1 = jnp.asarray(np.repeat([[1] * 3000 + [0] * (t - 3000)], 2, axis=0), jnp.int32)
    one = prepare_segments(seg1, impl="cudnn", dtype=q.dtype, max_segments=1)
    real = (seg1 > 0)[:, :, None, None]
    cot1 = jnp.where(real, cot, 0)

    def one_sample(impl, runs):
        def f(q, kk, v):
            return jnp.sum((attention(q, kk, v, seg1, impl=impl, runs=runs) * cot1).astype(jnp.float32))

        o = jax.jit(lambda q, kk, v: attention(q, kk, v, seg1, impl=impl, runs=runs))(q, kk, v)
        return jnp.where(real, o, 0), jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, kk, v)

    (o1_ref, g1_ref), (o1, g1) = one_sample("xla", None), one_sample("cudnn", one)
    errs["causal_out"] = _rel(o1, o1_ref)
    errs.update({f"causal_d{n}": _rel(a, b) for n, a, b in zip("qkv", g1, g1_ref, strict=True)})
    out["causal_overflow_flagged"] = [bool(x) for x in np.asarray(
        prepare_segments(seg, impl="cudnn", dtype=q.dtype, max_segments=1).overflow)]
    # LM head + logprobs: chunked (recomputed per chunk) vs full fp32 logits.
    b, t, d, vocab = 1, 4096, 1024, 151936
    k = jax.random.split(jax.random.key(1), 5)
    h = jax.random.normal(k[0], (b, t, d), jnp.bfloat16)
    w = 0.02 * jax.random.normal(k[1], (d, vocab), jnp.float32)
    y = jax.random.randint(k[2], (b, t), 0, vocab)
    tau = jax.random.uniform(k[3], (b, t), minval=0.7, maxval=1.3)
    coef = jax.random.normal(k[4], (b, t))

    def head(fn):
        def f(h, w):
            lp, ent = fn(h, w)
            return jnp.sum(coef * lp) + 0.1 * jnp.sum(ent), (lp, ent)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)

    (l_f, (lp_f, ent_f)), (gh_f, gw_f) = head(lambda h, w: token_logprobs(h, w, y, tau, 1024))
    (l_r, (lp_r, ent_r)), (gh_r, gw_r) = head(lambda h, w: token_logprobs_reference(h, w, y, tau))
    errs.update(head_loss=_rel(l_f, l_r), head_logprobs=_rel(lp_f, lp_r), head_entropy=_rel(ent_f, ent_r),
                head_dh=_rel(gh_f, gh_r), head_dw=_rel(gw_f, gw_r))
    (l_f, (lp_f, ent_f)), (gh_f, gw_f) = head(lambda h, w: fused_token_logprobs(h, w, y, tau, 1024))
    errs.update(fused_head_loss=_rel(l_f, l_r), fused_head_logprobs=_rel(lp_f, lp_r),
                fused_head_entropy=_rel(ent_f, ent_r), fused_head_dh=_rel(gh_f, gh_r), fused_head_dw=_rel(gw_f, gw_r))
    # The same head keeping its fp32 logits for the backward instead of recomputing them.
    (l_f, (lp_f, ent_f)), (gh_f, gw_f) = head(lambda h, w: fused_token_logprobs(h, w, y, tau, 1024, 1 << 40))
    errs.update(saved_head_loss=_rel(l_f, l_r), saved_head_logprobs=_rel(lp_f, lp_r),
                saved_head_entropy=_rel(ent_f, ent_r), saved_head_dh=_rel(gh_f, gh_r), saved_head_dw=_rel(gw_f, gw_r))
    out["errors"] = errs
    out["ok"] = (all(np.isfinite(e) and e < tol for e in errs.values()) and out["overflow_flagged"] == [True, False]
                 and out["causal_overflow_flagged"] == [True, False])
    if c.get("kernels"):
        out["kernels"] = _kernel_sweep()
    return out


def _kernel_sweep() -> dict:
    """Attention fwd+bwd TFLOP/s: packed cuDNN at several max_segments vs cuDNN's plain causal kernel."""
    import jax
    import jax.numpy as jnp

    from primejax.models.attention import attention

    res = {}
    for t in (16384, 65536):
        k = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(k[0], (1, t, 16, 128), jnp.bfloat16)
        kk = jax.random.normal(k[1], (1, t, 8, 128), jnp.bfloat16)
        v = jax.random.normal(k[2], (1, t, 8, 128), jnp.bfloat16)
        seg = jnp.ones((1, t), jnp.int32)
        lens = jnp.full((1,), t, jnp.int32)
        flops = 2 * 2 * t * t / 2 * 16 * 128 * 3.5
        variants = {f"packed_m{m}": (lambda q, kk, v, m=m, seg=seg: attention(q, kk, v, seg, impl="cudnn",
                                                                             max_runs=m))
                    for m in (2, 64)}
        variants["plain_causal"] = lambda q, kk, v: jax.nn.dot_product_attention(
            q, kk, v, is_causal=True, implementation="cudnn")
        variants["padded_causal"] = lambda q, kk, v, lens=lens: jax.nn.dot_product_attention(
            q, kk, v, is_causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens, implementation="cudnn")
        if t <= 16384:  # Triton kernels: slow enough at 64k to eat the sweep's time
            variants["pallas_mha"] = lambda q, kk, v, seg=seg: _pallas_mha(q, kk, v, seg)
            variants["pallas_mha_b64"] = lambda q, kk, v, seg=seg: _pallas_mha(q, kk, v, seg, big=True)
        for name, fn in variants.items():
            g = jax.jit(jax.grad(lambda q, kk, v, fn=fn: jnp.sum(fn(q, kk, v).astype(jnp.float32) * 1e-3),
                                 argnums=(0, 1, 2)))
            fwd = jax.jit(fn)
            args = (q, kk, v)
            try:
                tf = _timed(fwd, lambda args=args: args, 5, 2)[1]
                tb = _timed(g, lambda args=args: args, 5, 2)[1]
                res[f"{t}:{name}"] = dict(fwd_ms=tf * 1e3, fwd_bwd_ms=tb * 1e3,
                                          fwd_tflops=flops / 3.5 / tf / 1e12, fwd_bwd_tflops=flops / tb / 1e12)
            except Exception as e:  # noqa: BLE001 - report and keep sweeping
                res[f"{t}:{name}"] = dict(error=repr(e)[:300])
    return res


def _pallas_mha(q, k, v, seg, big=False):
    """jax's Pallas (Triton) flash attention with segment ids; GQA by repeating k/v (the kernel has none)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention as pa

    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    blocks = pa.BlockSizes(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                           block_kv_dq=64) if big else pa.BlockSizes.get_default()
    return pa.mha(q, k, v, seg, sm_scale=q.shape[-1] ** -0.5, causal=True, block_sizes=blocks,
                  num_warps=8 if big else None)


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
    return dict(tok_s=tokens / dt, step_ms=dt * 1e3, compile_s=first, loss=float(loss),
                mfu=tokens * fpt / dt / PEAK_FLOPS, peak_gib=peak())


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
            lines.append(f"{r['name']:<24}{r['seq']:>7}{r['rows']:>5}{r['tok_s']:>10.0f}{100 * r['mfu']:>6.1f}%"
                         f"{r['step_ms']:>10.1f}{r['peak_gib']:>10.1f}{ratio:>9}  {label}")
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
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds for the whole suite (0 = none): configurations that would start later are skipped")
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
