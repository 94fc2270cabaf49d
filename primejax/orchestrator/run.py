"""Wiring for a real run: client, tokenizer, monitor and resume around `Orchestrator`."""

from __future__ import annotations

import json
from pathlib import Path

from ml_collections import ConfigDict

from primejax.inference.admin_auth import read_token
from primejax.inference.client import InferenceClient
from primejax.monitor import Monitor
from primejax.orchestrator.loop import Orchestrator
from primejax.orchestrator.renderer import load_tokenizer
from primejax.rundir import run_dir


def base_urls(cfg: ConfigDict) -> list[str]:
    """`orchestrator.client.base_urls`, or the run's own inference server when that is empty."""
    urls = list(cfg.orchestrator.client.base_urls)
    return urls or [f"http://{cfg.inference.host}:{cfg.inference.port}"]


def model_vocab_size(model_path: str) -> int | None:
    """The policy's vocabulary size from its config.json (None when it cannot be read)."""
    try:
        vocab = json.loads((Path(model_path) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return vocab if isinstance(vocab, int) and vocab > 0 else None


async def run_orchestrator(cfg: ConfigDict) -> list[dict[str, float]]:
    root = run_dir(cfg)
    c = cfg.orchestrator.client
    client = InferenceClient(base_urls(cfg), timeout_s=c.timeout_s, max_retries=c.max_retries,
                             vocab_size=model_vocab_size(cfg.model.path), admin_token=read_token(root))
    monitor = Monitor(root, "orchestrator", tensorboard=cfg.monitor.tensorboard, jsonl=cfg.monitor.jsonl)
    try:
        await client.wait_ready(cfg.inference.startup_timeout_s)
        orchestrator = Orchestrator(cfg, client=client, tokenizer=load_tokenizer(cfg.model.path), run_dir=root,
                                    monitor=monitor)
        orchestrator.resume(cfg.run.resume_step)
        # Start from a known policy: the base model. A server left serving another (or a killed) run's weights
        # is reset; the watcher then loads the newest broadcast of this run, which a resumed trainer re-exports.
        await orchestrator.tracker.resync()
        try:
            return await orchestrator.run(cfg.run.max_steps)
        finally:
            await orchestrator.close()  # the algorithms' frozen-model clients (teacher, frozen sampler)
    finally:
        monitor.close()
        await client.close()
