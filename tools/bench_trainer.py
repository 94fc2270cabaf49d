"""Trainer throughput on one GPU: the primejax RL/SFT step vs a plain torch + transformers step, side by side.

    python tools/bench_trainer.py                      # every configuration, then the table
    python tools/bench_trainer.py --only jax:16384:rl  # one configuration (see CONFIGS for the names)
    python tools/bench_trainer.py --smoke              # CPU: a tiny model through the same code, in seconds
    python tools/bench_trainer.py --suite lora         # Qwen3-8B / 0.6B LoRA RL steps next to full fine-tuning

Each configuration runs in its own process (clean peak-memory counters, an OOM stays contained), does
`--warmup` steps (the first one compiles) and then `--steps` timed steps that are dispatched back to back and
synchronized once at the end. Model: Qwen3-0.6B shape, random init. Fake data: full rows of random tokens, one
sample per row, loss over every token. The step is the trainer's own: built and compiled by the trainer engine
(primejax/trainer/engine.py) exactly as `Trainer` and SFT build it. Throughput counts every token; MFU uses prime-rl's formula
(`ModelConfig.flops_per_token`) over a 989 TFLOP/s bf16 peak.

The torch baseline is the naive trainer step the issue describes: transformers Qwen3ForCausalLM (sdpa), bf16
parameters, full fp32 logits, mean cross-entropy, grad-norm clip, torch AdamW; with and without gradient
checkpointing. Results (one JSON object per configuration) go to `--out` as they arrive, the table last.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (`python tools/bench_trainer.py`): the repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.bench_trainer_profile import bench_main, lora_options, time_engine_step  # noqa: E402
from tools.model_shapes import QWEN3  # noqa: E402

PEAK_FLOPS = 989e12
QWEN3_06B = dict(QWEN3["qwen3-0.6b"], max_position_embeddings=65536)  # rows up to 64k
GIB = 2.0**30


# ----------------------------------------------------------------------------------------------- configurations


def _jax(seq, rows=1, loss="rl", *, tag="", model="qwen3-0.6b", lora=0, **kw):
    """A primejax step row. kw (defaults below): remat, attn, chunk (logprob chunk), steps, warmup, trace, segs
    (the step's static bound on samples per row; the fake rows hold one), save_gib (the trainer's
    `lm_head_saved_logits_gib`: None = its default, auto; 0 = the head always recomputes), pdt (the parameters'
    dtype; with LoRA the frozen base's), export ("adapter" / "both": also time the step's broadcast as the
    trainer publishes it; "both": the merged full weights too). model: a tools/model_shapes.py QWEN3 name; lora:
    adapter rank (0 = full fine-tuning) on every attention and MLP projection."""
    name = f"jax:{seq}:{loss}" + ("" if rows == 1 else f":x{rows}") + (f":{tag}" if tag else "")
    name += ("" if model == "qwen3-0.6b" else f":{model}") + (f":lora{lora}" if lora else "")
    defaults = dict(
        remat="auto", attn="cudnn", chunk=2048, steps=5, warmup=2, trace=False, segs=1, save_gib=None,
        pdt="float32", export="",
    )  # fmt: skip
    return dict(defaults, **kw, kind="jax", name=name, seq=seq, rows=rows, loss=loss, model=model, lora=lora)


def _torch(seq, rows=1, ckpt=True, steps=4, warmup=2):
    name = f"torch:{seq}:{'ckpt' if ckpt else 'nockpt'}" + ("" if rows == 1 else f":x{rows}")
    return dict(kind="torch", name=name, seq=seq, rows=rows, ckpt=ckpt, loss="ce", steps=steps, warmup=warmup)


CONFIGS = {
    # The table of docs/benchmarks.md. "before": the head recomputes its logits in the backward at every size
    # (`lm_head_saved_logits_gib=0`), same process setup, same run.
    "main": [
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
    # LoRA (docs/lora.md): the RL step at 16k with rank-16 adapters on a frozen bf16 base next to full fine-tuning
    # in the same run, and the step's broadcast: the adapter vs the merged full weights. Qwen3-8B full fine-tuning
    # (bf16 weights and moments, 16 GB + 32 GB + gradients) is the baseline row even if it runs out of memory.
    "lora": [
        _jax(16384, model="qwen3-8b", lora=16, pdt="bfloat16", export="both", steps=3),
        _jax(16384, model="qwen3-8b", pdt="bfloat16", tag="full", steps=3),
        _jax(16384, lora=16, pdt="bfloat16", export="both"),
        _jax(16384, pdt="bfloat16", tag="full"),
    ],
    # CPU: the same worker code on a tiny model (`--smoke`), to check the script before a GPU run.
    "smoke": [
        dict(c, smoke=True)
        for c in (
            _jax(256, attn="xla", chunk=128, steps=2, warmup=1),
            _jax(128, rows=2, loss="ce", attn="xla", chunk=128, steps=2, warmup=1),
            _torch(128, ckpt=False, steps=1, warmup=1),
        )
    ],
    "smoke:lora": [
        dict(c, smoke=True)
        for c in (
            _jax(256, attn="xla", chunk=128, steps=2, warmup=1, lora=8, pdt="bfloat16", export="both"),
            _jax(256, attn="xla", chunk=128, steps=2, warmup=1, pdt="bfloat16", tag="full"),
        )
    ],
}
SMOKE_MODEL = dict(
    QWEN3_06B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, vocab_size=512,
)  # fmt: skip


# ----------------------------------------------------------------------------------------------- jax worker


def _hf_shape(c: dict) -> dict:
    if c.get("smoke"):
        return SMOKE_MODEL
    return dict(QWEN3[c.get("model", "qwen3-0.6b")], max_position_embeddings=65536)


def _model_config(c: dict):
    from primejax.models.config import ModelConfig

    return ModelConfig.from_hf_config(
        _hf_shape(c),
        param_dtype=c.get("pdt", "float32"),
        compute_dtype="bfloat16",
        attention_impl=c["attn"],
        remat_policy=c["remat"],
        **lora_options(c.get("lora", 0)),
    )


def _export_times(engine, cfg, full: bool) -> dict:
    """The step's broadcast as the trainer writes it (transports/weights/, bf16, sha256 in STABLE, into a temp
    run directory): the adapter alone (LoRA), and with `full` the merged full weights next to it."""
    import tempfile

    from primejax.trainer.config import BroadcastConfig
    from primejax.transports.weights.publish import AdapterPublisher, FilesystemPublisher

    out, b = {}, BroadcastConfig()
    with tempfile.TemporaryDirectory() as root:
        if cfg.lora_rank:
            m = AdapterPublisher(root, cfg, b, async_level=1).publish(1, engine.lora_model())
            out.update(adapter_export_s=m["export/seconds"], adapter_export_mb=m["export/gb"] * 1e3)
        if full:
            m = FilesystemPublisher(root, cfg, b, async_level=1).publish(2, engine.model())
            out.update(full_export_s=m["export/seconds"], full_export_gb=m["export/gb"])
    return out


def _fake_batch(rows: int, seq: int, vocab: int, loss: str, seed: int = 0) -> dict:
    """Random rows of every batch field (contracts.batch.FIELDS): the ones the step's cost depends on filled,
    the rest zeros of their dtype, so a field the contract gains reaches the benchmarks without an edit here."""
    import jax
    import jax.numpy as jnp

    from primejax.contracts.batch import FIELDS

    k = jax.random.split(jax.random.key(seed), 3)
    ones = jnp.ones((rows, seq), jnp.float32)
    zeros = jnp.zeros((rows, seq), jnp.float32)
    rl = loss == "rl"
    filled = {
        "tokens": jax.random.randint(k[0], (rows, seq), 0, vocab, dtype=jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)),
        "segment_ids": jnp.ones((rows, seq), jnp.int32),
        "temperatures": ones,
        "loss_mask": jnp.ones((rows, seq), bool),
        "inference_logprobs": -jax.random.uniform(k[1], (rows, seq), minval=0.0, maxval=12.0),
        "advantages": jax.random.normal(k[2], (rows, seq)),
        "rl_weights": ones if rl else zeros,
        "ce_weights": zeros if rl else ones,
    }
    return {name: filled.get(name, jnp.zeros((rows, seq), dtype)) for name, dtype in FIELDS.items()}


def jax_worker(c: dict) -> dict:
    """The trainer engine's step on this host's devices (mesh: `trainer.mesh` defaults), fake rows, timed."""
    import jax
    import numpy as np

    from primejax.models.remat import resolve_remat_policy
    from primejax.trainer.config import TrainerConfig
    from primejax.trainer.engine import Engine
    from primejax.trainer.fused_head import saved_logits_bytes

    cfg = _model_config(c)
    rows, seq = c["rows"], c["seq"]
    t = TrainerConfig(
        micro_batch_size=rows,
        logprob_chunk_size=c["chunk"],
        lm_head_saved_logits_gib=-1.0 if c.get("save_gib") is None else float(c["save_gib"]),
    )
    engine = Engine.create(t, cfg, seed=0)
    kind = "sft" if c["loss"] == "ce" else "rl"
    host = {k: np.asarray(v)[None] for k, v in _fake_batch(rows, seq, cfg.vocab_size, c["loss"]).items()}
    res = time_engine_step(engine, host, kind, c.get("segs", 1), c)
    dt, tokens = res.pop("step_s"), rows * seq
    head_bytes = saved_logits_bytes(tokens, cfg.vocab_size, "bfloat16")
    res.update(
        tok_s=tokens / dt,
        step_ms=dt * 1e3,
        mfu=tokens * cfg.flops_per_token(seq) / dt / PEAK_FLOPS,
        remat_resolved=resolve_remat_policy(c["remat"], rows * seq),
        head_saves_logits=0 < head_bytes <= engine.saved_logits_bytes,
    )
    if c.get("lora"):
        res["adapter_params"] = sum(int(x.size) for x in jax.tree.leaves(engine.state.params))
    if c.get("export"):
        res.update(_export_times(engine, cfg, full=c["export"] == "both"))
    return res


# ----------------------------------------------------------------------------------------------- torch worker


def torch_worker(c: dict) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    hf = dict(_hf_shape(c))
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

    fpt = ModelConfig.from_hf_config(_hf_shape(c)).flops_per_token(seq)
    return dict(
        tok_s=tokens / dt,
        step_ms=dt * 1e3,
        compile_s=first,
        loss=float(loss),
        mfu=tokens * fpt / dt / PEAK_FLOPS,
        peak_gib=peak(),
    )


# ----------------------------------------------------------------------------------------------- driver

WORKERS = {"jax": jax_worker, "torch": torch_worker}


def _env(c: dict, smoke: bool) -> dict:
    return dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.94", PYTHONUNBUFFERED="1")


def _notes(r: dict) -> str:
    if r["kind"] != "jax":
        return ""
    notes = (
        f"remat={r.get('remat_resolved') or r['remat']} attn={r['attn']} segs={r['segs']} chunk={r['chunk']}"
    )
    notes += " head=saved" if r.get("head_saves_logits") else " head=recompute"
    if r.get("memory", {}).get("temp") is not None:
        notes += f" temp={r['memory']['temp']:.1f}G"
    if r.get("adapter_export_s") is not None:
        notes += f" export: adapter {r['adapter_export_mb']:.1f}MB {r['adapter_export_s']:.2f}s"
    if r.get("full_export_s") is not None:
        notes += f" full {r['full_export_gb']:.2f}GB {r['full_export_s']:.1f}s"
    return notes


def _table(results: list[dict]) -> str:
    torch_best: dict[tuple, float] = {}  # the faster torch row of each shape is the jax rows' baseline
    for r in (r for r in results if r["kind"] == "torch" and r.get("tok_s")):
        torch_best[r["seq"], r["rows"]] = max(torch_best.get((r["seq"], r["rows"]), 0.0), r["tok_s"])
    head = f"{'impl':<24}{'seq':>7}{'rows':>5}{'tok/s':>10}{'MFU':>7}{'step ms':>10}{'peak GiB':>10}{'vs torch':>9}  notes"
    lines = [head, "-" * len(head)]
    for r in results:
        row = f"{r['name']:<24}{r['seq']:>7}{r['rows']:>5}"
        if not r.get("tok_s"):
            lines.append(f"{row}{'OOM' if r.get('oom') else 'FAIL':>10}{'':>36}  {_notes(r)}")
            continue
        best = torch_best.get((r["seq"], r["rows"])) if r["kind"] == "jax" else None
        ratio = f"{r['tok_s'] / best:.2f}x" if best else ""
        lines.append(
            f"{row}{r['tok_s']:>10.0f}{100 * r['mfu']:>6.1f}%{r['step_ms']:>10.1f}{r['peak_gib']:>10.1f}{ratio:>9}"
            f"  {_notes(r)}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main(__doc__, CONFIGS, WORKERS, _table, _env, script=__file__, suite="main", timeout=300.0)
