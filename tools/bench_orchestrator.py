"""Orchestrator overhead per step against a stub inference server that answers instantly.

    python -m tools.bench_orchestrator [--rollouts 256] [--tokens 256] [--group-size 8] [--steps 5]

The stub (stdlib HTTP server, its own process) implements the `/v1/completions` shape the client uses and
returns `--tokens` random token ids with logprobs for each of the `n` samples. Everything the orchestrator
process does is overhead here: rendering prompts, HTTP and JSON, decoding replies, scoring, credit,
filters, sample building, packing and the atomic batch write. Reported per step: wall time, the
orchestrator process's CPU time (wall minus time it sat waiting, i.e. "everything but waiting on the
server"), and the stage split.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server
    vocab = 300

    def log_message(self, *args):
        pass

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.path == "/v1/models":
            self._send({"data": [{"id": "stub"}]})
        elif self.path == "/weights_version":
            self._send({"version": 0})
        else:
            self._send({"ok": True})

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        rng = random.Random(req.get("seed", json.dumps(req["prompt"])))  # reproducible without seeds
        choices = []
        for i in range(req["n"]):
            ids = [rng.randrange(3, self.vocab) for _ in range(req["max_tokens"])]
            choices.append(
                {
                    "index": i,
                    "text": "",
                    "token_ids": ids,
                    "prompt_token_ids": req["prompt"],
                    "finish_reason": "length",
                    "logprobs": {"token_logprobs": [-rng.random() * 3 for _ in ids]},
                }
            )
        self._send({"choices": choices})


def serve_stub(port: int) -> None:
    ThreadingHTTPServer(("127.0.0.1", port), _Stub).serve_forever()


def _config(run_dir: Path, args: argparse.Namespace):
    from primejax.config import default_config

    cfg = default_config()
    cfg.run.output_dir, cfg.run.name = str(run_dir.parent), run_dir.name
    cfg.model.path = "stub"
    o = cfg.orchestrator
    o.batch_size, o.group_size = args.rollouts, args.group_size
    o.max_concurrent = 64
    o.seq_len, o.max_prompt_tokens = args.tokens + 256, 256
    o.sampling.max_tokens = args.tokens
    o.async_level = args.steps + 1  # no trainer: never wait for weights
    return cfg


async def _bench(args: argparse.Namespace, url: str, tokenizer) -> list[dict[str, float]]:
    from primejax.config import typed
    from primejax.inference.client import InferenceClient
    from primejax.orchestrator.loop import Orchestrator

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(Path(tmp) / "run", args)
        client = InferenceClient(url, timeout_s=60, max_retries=0)
        try:
            await client.wait_ready(30)
            orch = Orchestrator(typed(cfg).orchestrator, client=client, tokenizer=tokenizer, run_dir=Path(tmp) / "run")
            for step in range(1, args.steps + 2):
                wall, cpu = time.perf_counter(), time.process_time()
                result = await orch.step(step)
                m = result.metrics
                row = {
                    "wall_s": time.perf_counter() - wall,
                    "cpu_s": time.process_time() - cpu,
                    "generate_s": m["time/generate"],
                    "post_s": m["time/postprocess"],
                    "samples": m["samples/count"],
                    "tokens": m["seq_len/mean"] * m["samples/count"],
                }
                if step > 1:  # the first step pays imports and connection setup
                    rows.append(row)
        finally:
            await client.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--serve-stub", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_stub:
        serve_stub(args.port)
        return

    import socket

    from primejax.models.tiny import build_tokenizer
    from primejax.rendering.renderer import load_tokenizer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stub = subprocess.Popen(
        [sys.executable, "-m", "tools.bench_orchestrator", "--serve-stub", "--port", str(port)]
    )
    try:
        with tempfile.TemporaryDirectory() as tok_dir:
            build_tokenizer(Path(tok_dir))
            tokenizer = load_tokenizer(tok_dir)
        rows = asyncio.run(_bench(args, f"http://127.0.0.1:{port}", tokenizer))
    finally:
        stub.terminate()
        stub.wait(10)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(
        f"orchestrator overhead, {args.rollouts} rollouts x {args.tokens} tokens "
        f"(group {args.group_size}), stub server, median of {len(rows)} steps"
    )
    print("| wall s/step | orchestrator CPU s/step | generate s | post-process s | samples | tokens |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {med('wall_s'):.3f} | {med('cpu_s'):.3f} | {med('generate_s'):.3f} | {med('post_s'):.3f} "
        f"| {med('samples'):.0f} | {med('tokens'):.0f} |"
    )


if __name__ == "__main__":
    main()
