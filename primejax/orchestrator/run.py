"""Wiring for a real run: client, tokenizer, monitor and resume around `Orchestrator`."""

from __future__ import annotations

from ml_collections import ConfigDict

from primejax.inference.client import InferenceClient
from primejax.monitor import Monitor
from primejax.orchestrator.loop import Orchestrator
from primejax.orchestrator.renderer import load_tokenizer
from primejax.rundir import run_dir


def base_urls(cfg: ConfigDict) -> list[str]:
    """`orchestrator.client.base_urls`, or the run's own inference server when that is empty."""
    urls = list(cfg.orchestrator.client.base_urls)
    return urls or [f"http://{cfg.inference.host}:{cfg.inference.port}"]


async def run_orchestrator(cfg: ConfigDict) -> list[dict[str, float]]:
    root = run_dir(cfg)
    c = cfg.orchestrator.client
    client = InferenceClient(base_urls(cfg), timeout_s=c.timeout_s, max_retries=c.max_retries)
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
