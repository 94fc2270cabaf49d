"""Wiring for a real run: client, tokenizer, monitor and resume around `Orchestrator`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from primejax.inference.admin_auth import read_token
from primejax.inference.client import InferenceClient
from primejax.inference.routed_experts import RoutingShape
from primejax.inference.server import InferenceConfig
from primejax.orchestrator.config import ClientConfig
from primejax.orchestrator.loop import Orchestrator
from primejax.rendering.renderer import load_tokenizer
from primejax.utils.monitor import Monitor
from primejax.utils.sections import ConfigError

if TYPE_CHECKING:
    from primejax.config import Config


def base_urls(client: ClientConfig, inference: InferenceConfig) -> list[str]:
    """`orchestrator.client.base_urls`, or the run's own inference server when that is empty."""
    if client.base_urls:
        return list(client.base_urls)
    if not inference.port:
        raise ConfigError("inference.port", "0 (a free port the launcher picks) is not an address: started on its "
                          "own, the orchestrator needs the server's port (--config.inference.port=N, the port "
                          "`python -m primejax.inference` printed) or orchestrator.client.base_urls")
    return [f"http://{inference.host}:{inference.port}"]


def model_vocab_size(model_path: str) -> int | None:
    """The policy's vocabulary size from its config.json (None when it cannot be read)."""
    try:
        vocab = json.loads((Path(model_path) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def policy_client(client: ClientConfig, inference: InferenceConfig, vocab_size: int | None = None,
                  admin_token: str | None = None) -> InferenceClient:
    """The live policy's client; with `vocab_size`, answers with token ids outside the vocabulary are rejected."""
    return InferenceClient(base_urls(client, inference), timeout_s=client.timeout_s, max_retries=client.max_retries,
                           vocab_size=vocab_size, admin_token=admin_token,
                           api_key_var=client.api_key_env)


async def run_orchestrator(cfg: Config) -> list[dict[str, float]]:
    """The orchestrator process's work (entry: `python -m primejax.orchestrator`)."""
    root = cfg.run_dir
    client = policy_client(cfg.orchestrator.client, cfg.inference, model_vocab_size(cfg.model.path),
                           admin_token=read_token(root))
    monitor = Monitor.from_config(root, "orchestrator", cfg.monitor, cfg.to_dict())
    try:
        await client.wait_ready(cfg.inference.startup_timeout_s)
        orchestrator = Orchestrator(
            cfg.orchestrator, client=client, tokenizer=load_tokenizer(cfg.model.path), run_dir=root,
            seed=cfg.run.seed, num_shards=cfg.trainer.distributed.num_processes,
            pad_rows_to_multiple=cfg.trainer.micro_batch_size,
            # An outage may include a server restart (up to its start-up time) after the client's own retries.
            recovery_timeout_s=2 * cfg.inference.startup_timeout_s, monitor=monitor,
            routing=RoutingShape.of_model_dir(cfg.model.path) if cfg.orchestrator.routing_replay else None,
            watch=cfg.monitor,
        )
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
