"""Inference server figures: start-up time, in-place reload seconds, generation throughput.

    python -m tools.bench_inference [--out-dir outputs/bench_inference] [--skip-06b] [--json out.json]

Two models, each served by a fresh vLLM server (primejax routes, `--enforce-eager`):
- tiny: the test model (primejax.models.tiny, fp32, ~100k params);
- qwen3-0.6b-shaped: Qwen3-0.6B's architecture (28 layers, d=1024, GQA 16/8, tied, vocab 151936) with
  random bf16 weights from transformers, then loaded into primejax and exported again with
  `export_safetensors` (the trainer's broadcast path) as the update directory.
For each: seconds from process start to /liveness, /update_weights wall time (client side; median of
several) and the server's own load time, /reload_weights, and tokens/s for 32 prompts x 256 new tokens
(ignore_eos, temperature 1) sent concurrently.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx

from primejax.inference.process import InferenceServerProcess
from primejax.inference.server import ServerSpec
from tools.model_shapes import QWEN3

# transformers.Qwen3Config keyword arguments (its own model_type)
QWEN3_06B = {k: v for k, v in QWEN3["qwen3-0.6b"].items() if k != "model_type"}


def build_qwen3_06b_shaped(out: Path, tokenizer_src: Path) -> Path:
    """Random-init Qwen3-0.6B-shaped model in bf16 (transformers), with the tiny model's tokenizer files."""
    import shutil

    import torch
    import transformers

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**QWEN3_06B, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    with torch.device("cpu"):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tokenizer_src / name, out / name)
    return out


def export_with_primejax(src: Path, out: Path, dtype: str) -> dict:
    """Load `src` into primejax and export it to `out` (what the trainer writes to broadcasts/step_N)."""
    from primejax.models.hf_io import export_safetensors, load_model

    t0 = time.perf_counter()
    model, cfg = load_model(src, param_dtype="float32" if dtype == "float32" else "bfloat16")
    load_s = time.perf_counter() - t0
    stats = export_safetensors(model, cfg, out, dtype=dtype, src_dir=src)
    return {"primejax_load_s": load_s, "export_s": stats["seconds"], "export_gb": stats["bytes"] / 1e9}


async def _timed_post(h: httpx.AsyncClient, url: str, body: dict | None = None) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = await h.post(url, json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


async def measure(base_url: str, update_dir: Path, repeats: int, prompts: int, new_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=1800) as h:
        model = (await h.get(f"{base_url}/v1/models")).json()["data"][0]["id"]
        updates, server_loads = [], []
        for i in range(repeats):
            wall, body = await _timed_post(
                h, f"{base_url}/update_weights", {"weight_dir": str(update_dir), "version": i + 1}
            )
            updates.append(wall)
            server_loads.append(body["load_seconds"])
        reload_wall, _ = await _timed_post(h, f"{base_url}/reload_weights")

        async def one(i: int) -> int:
            r = await h.post(
                f"{base_url}/v1/completions",
                json={
                    "model": model,
                    "prompt": [1, 10 + i, 20 + i, 30 + i],
                    "max_tokens": new_tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "seed": i,
                    "logprobs": 0,
                    "return_token_ids": True,
                },
            )
            r.raise_for_status()
            return len(r.json()["choices"][0]["token_ids"])

        await one(0)  # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(prompts)))
        gen_s = time.perf_counter() - t0
    return {
        "update_weights_s_median": statistics.median(updates),
        "update_weights_s_all": updates,
        "server_load_s_median": statistics.median(server_loads),
        "reload_weights_s": reload_wall,
        "generated_tokens": sum(counts),
        "generation_s": gen_s,
        "tokens_per_s": sum(counts) / gen_s,
    }


def bench_model(
    name: str, model_dir: Path, update_dir: Path, log_dir: Path, port: int, args, dtype: str = "auto"
) -> dict:
    spec = ServerSpec(model=str(model_dir), port=port, max_model_len=1024, dtype=dtype)
    with InferenceServerProcess(spec, log_dir / f"{name}.log") as proc:
        startup = proc.wait_healthy(600)
        res = asyncio.run(measure(spec.base_url, update_dir, args.repeats, args.prompts, args.new_tokens))
    res["startup_s"] = startup
    res["served_dtype"] = spec.resolved_dtype()
    return res


def _fmt(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="outputs/bench_inference")
    p.add_argument("--skip-06b", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--json", default="")
    p.add_argument("--dtype-06b", default="auto", help="served dtype of the 0.6B-shaped model (auto = bf16)")
    args = p.parse_args()

    from primejax.models.tiny import build_tiny_model

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny = out / "tiny"
    if not (tiny / "primejax_tiny.json").exists():
        build_tiny_model(tiny)
    results: dict[str, dict] = {}
    tiny_update = out / "broadcasts-tiny" / "step_1"
    export = export_with_primejax(tiny, tiny_update, "float32") if not tiny_update.exists() else {}
    results["tiny"] = {**export, **bench_model("tiny", tiny, tiny_update, out, args.port, args)}
    print(json.dumps({"tiny": results["tiny"]}, indent=1), flush=True)

    if not args.skip_06b:
        big = out / "qwen3-0.6b-shaped"
        t0 = time.perf_counter()
        build_qwen3_06b_shaped(big, tiny)
        build_s = time.perf_counter() - t0
        big_update = out / "broadcasts-0.6b" / "step_1"
        export = export_with_primejax(big, big_update, "bfloat16") if not big_update.exists() else {}
        results["qwen3-0.6b-shaped"] = {
            "build_s": build_s,
            **export,
            **bench_model("qwen3-0.6b", big, big_update, out, args.port + 1, args, args.dtype_06b),
        }
        print(json.dumps({"qwen3-0.6b-shaped": results["qwen3-0.6b-shaped"]}, indent=1), flush=True)

    print(f"\nmachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end\n")
    print(
        "| model | dtype | server start (s) | /update_weights (s, median) | server-side load (s) | /reload_weights (s) "
        f"| tokens/s ({args.prompts}x{args.new_tokens}) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['served_dtype']} | {_fmt(r['startup_s'])} | {_fmt(r['update_weights_s_median'])} | "
            f"{_fmt(r['server_load_s_median'])} | {_fmt(r['reload_weights_s'])} | {r['tokens_per_s']:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
