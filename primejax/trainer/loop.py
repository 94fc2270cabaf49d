"""The trainer process: for n = start+1 .. max_steps, wait for rollouts/step_n, train, export, checkpoint, log.

Step n turns θ_{n-1} into θ_n from the rollouts of step n and writes θ_n to `broadcasts/step_n/`; the
broadcasts older than n - async_level are deleted (inference may still be asked for those). With
`trainer.fake_data.enabled` the rollouts are replaced by random full rows (benchmark mode: throughput and
MFU, prime-rl's formula; no export unless `fake_data.export`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from primejax.contracts.batch import BatchFormatError, PackedBatch, prune_rollouts, read_batch, wait_for_batch
from primejax.contracts.rundir import RunConfig, RunDir
from primejax.models.settings import ModelSettings
from primejax.trainer.checkpoint import TrainerCheckpointer, complete_steps, resolve_resume_step
from primejax.trainer.config import DistributedConfig, TrainerConfig
from primejax.trainer.corrections import CorrectionTable
from primejax.trainer.engine import Engine, build_model, model_config
from primejax.trainer.moe_metrics import expert_devices, flatten_moe_metrics
from primejax.trainer.step import TrainState
from primejax.transports.weights.filesystem.broadcast import broadcast_dir, is_stable
from primejax.transports.weights.publish import make_publisher, publishes_adapters
from primejax.utils.faults import fault_point
from primejax.utils.monitor import Monitor

log = logging.getLogger("primejax.trainer")


class NonFiniteError(RuntimeError):
    """A step produced a NaN/inf loss or gradient and `trainer.on_nonfinite` is "stop"."""


def fake_batch(rng: np.random.Generator, rows: int, seq_len: int, vocab: int) -> PackedBatch:
    """Random full rows, one sample each, every token but the first trained with the rl loss."""
    b = PackedBatch.empty(rows, seq_len)
    b.tokens[:] = rng.integers(0, vocab, (rows, seq_len), dtype=np.int32)
    b.positions[:] = np.arange(seq_len, dtype=np.int32)
    b.segment_ids[:] = 1
    b.loss_mask[:, 1:] = True
    b.inference_logprobs[:, 1:] = -rng.uniform(0.05, 5.0, (rows, seq_len - 1)).astype(np.float32)
    b.advantages[:] = rng.standard_normal((rows, 1)).astype(np.float32)
    b.rl_weights[:] = 1.0
    b.meta = {"max_segments": 1}
    return b


class Trainer:
    """Holds the model, state, jitted steps and writers of one trainer process."""

    def __init__(
        self,
        t: TrainerConfig,
        model: ModelSettings,
        run: RunConfig,
        *,
        async_level: int = 1,
        num_receivers: int = 1,
        corrections: CorrectionTable | None = None,
    ):
        """`async_level` (orchestrator.async_level): how many older broadcasts inference may still be asked for;
        `num_receivers`: inference servers a collective transfer goes to (orchestrator.client.base_urls);
        `corrections`: the rl loss's off-policy corrections per environment (trainer/corrections.py)."""
        self.corrections = corrections or CorrectionTable()
        self.t, self.model_settings, self.run_cfg, self.async_level = t, model, run, async_level
        self.num_receivers = num_receivers
        self.root = run.dir
        self.rank = jax.process_index()
        self.engine = Engine.from_settings(
            t,
            model,
            seed=run.seed,
            max_steps=run.max_steps,
            max_positions=t.fake_data.seq_len,
            corrections=self.corrections,
        )
        self.mesh, self.model_cfg = self.engine.mesh, self.engine.model_cfg
        self.checkpointer = TrainerCheckpointer(
            self.root, keep=t.checkpoint.keep, async_save=t.checkpoint.async_save
        )
        self.start_step = 0
        resume = resolve_resume_step(self.root, run.resume_step)
        if resume is not None:
            self.state, meta = self.checkpointer.restore(resume, self.state)
            self.start_step = int(meta["step"])
            log.info("resumed from checkpoint step %d", self.start_step)
        self.skipped_steps = 0
        self.export_enabled = not t.fake_data.enabled or t.fake_data.export
        self.publisher = make_publisher(
            t.broadcast,
            self.root,
            self.model_cfg,
            async_level=async_level,
            max_steps=run.max_steps,
            checkpoint_interval=t.checkpoint.interval,
            num_receivers=num_receivers,
            src_dir=model.path or None,
        )
        if (
            resume is not None
            and self.export_enabled
            and not is_stable(broadcast_dir(self.root, self.start_step))
        ):
            # The orchestrator must serve θ_start before it samples the next step; the broadcast of it was
            # likely pruned (or set aside by the launcher) in the run that died, so write it again.
            self.export(self.start_step, disk_only=True)

    @property
    def state(self) -> TrainState:
        return self.engine.state

    @state.setter
    def state(self, value: TrainState) -> None:
        self.engine.state = value

    def next_batch(self, step: int, rng: np.random.Generator) -> PackedBatch:
        t = self.t
        if t.fake_data.enabled:
            return fake_batch(
                rng, t.fake_data.rows // jax.process_count(), t.fake_data.seq_len, self.model_cfg.vocab_size
            )
        path = wait_for_batch(self.root, step, self.rank, timeout_s=t.batch_timeout_s, poll_s=0.2)
        m = self.model_cfg
        routing = (len(m.sparse_layers()), m.num_experts_per_tok) if m.num_experts else None
        batch = read_batch(
            path, vocab_size=m.vocab_size, num_experts=m.num_experts or None, routing_shape=routing
        )
        envs = tuple(batch.meta.get("envs") or ())
        if envs and envs != self.corrections.env_names:
            raise BatchFormatError(
                path,
                "meta.envs",
                f"{list(envs)} are not this trainer's environments "
                f"{list(self.corrections.env_names)} (orchestrator.envs)",
            )
        return batch

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        start = time.perf_counter()
        metrics, tokens = self.engine.train(batch, "rl")
        metrics, self.histograms = flatten_moe_metrics(
            metrics, self.model_cfg.sparse_layers(), expert_devices(self.model_cfg, self.mesh)
        )
        seconds = time.perf_counter() - start
        seq_len = batch.seq_len
        flops = self.model_cfg.flops_per_token(seq_len) * tokens / seconds
        metrics.update(
            {
                "perf/step_s": seconds,
                "perf/tokens_per_s": tokens / seconds,
                "perf/mfu": flops / (self.t.peak_flops * jax.device_count()),
                "perf/tokens": float(tokens),
                "batch/num_samples": float(batch.meta.get("num_samples", 0)),
                "batch/padding_frac": float(1.0 - (batch.segment_ids > 0).mean()),
            }
        )
        if "max_policy_version" in batch.meta:
            metrics["batch/min_policy_version"] = float(batch.meta["min_policy_version"])
        return metrics

    def export(self, step: int, disk_only: bool = False) -> dict[str, float]:
        """Hand θ_step to inference through the run's publisher (transports/weights/publish.py: broadcasts/step_<step>/ on
        disk, or a collective send with the disk copy where one is needed) and prune what inference can no
        longer ask for. `disk_only`: write the disk copy whatever the mode (the re-export on resume)."""
        if not self.export_enabled:
            return {}
        self.check_finite_params(step, "exporting")
        fault_point("trainer.export", step, path=RunDir(self.root).broadcasts(step))
        adapters = publishes_adapters(self.t.broadcast, self.model_cfg)  # the adapters alone, no merge
        model = self.engine.lora_model() if adapters else self.engine.model()
        return self.publisher.publish(step, model, disk_only=disk_only)

    def prune_consumed(self, step: int) -> None:
        """Delete consumed batches nothing will read again (after step `step`, which every rank has read).

        A launcher resume regenerates every batch after its checkpoint, but a trainer resumed on its own reads
        the batches after its newest finished checkpoint again, so those stay, as do the newest `keep_rollouts`.
        """
        t = self.t
        if t.keep_rollouts < 0 or t.fake_data.enabled:
            return
        through = step - t.keep_rollouts
        if t.checkpoint.interval > 0:
            through = min(through, max(complete_steps(self.root), default=0))
        if through > 0:
            prune_rollouts(self.root, self.rank, through)

    def check_finite_params(self, step: int, doing: str) -> None:
        """Raise NonFiniteError rather than write non-finite parameters anywhere (the step guard skips updates
        that would make them; this holds whatever the cause, e.g. a restored checkpoint)."""
        if not self.engine.params_finite():
            raise NonFiniteError(f"step {step}: the parameters are non-finite (NaN/inf); not {doing} them")

    def maybe_checkpoint(self, step: int, final: bool = False) -> None:
        interval = self.t.checkpoint.interval
        if interval > 0 and (step % interval == 0 or final):
            self.check_finite_params(step, "checkpointing")
            meta = {"data_step": step + 1, "model_path": self.model_settings.path}
            if self.model_settings.lora.enabled:  # the state holds the adapters only: name what they adapt
                meta["lora"] = self.model_settings.lora.to_dict()
            self.checkpointer.save(step, self.state, meta)

    def run(self, monitor: Monitor | None = None) -> TrainState:
        max_steps = self.run_cfg.max_steps
        rng = np.random.default_rng(self.run_cfg.seed + self.start_step)
        last = self.start_step
        try:
            for step in range(self.start_step + 1, max_steps + 1):
                wait_start = time.perf_counter()
                batch = self.next_batch(step, rng)
                waited = time.perf_counter() - wait_start
                metrics = self.train_step(batch)
                metrics["perf/wait_s"] = waited
                fault_point("trainer.after_update", step)
                if metrics["nonfinite"]:
                    if self.t.on_nonfinite == "stop":
                        raise NonFiniteError(
                            f"step {step}: non-finite loss, gradient or update "
                            f"(loss={metrics['loss']}, grad_norm={metrics['grad_norm']})"
                        )
                    self.skipped_steps += 1
                    log.warning(
                        "step %d: non-finite loss, gradient or update (loss=%s, grad_norm=%s); update "
                        "skipped (%d skipped so far)",
                        step,
                        metrics["loss"],
                        metrics["grad_norm"],
                        self.skipped_steps,
                    )
                metrics["skipped_steps"] = float(self.skipped_steps)
                metrics.update(self.export(step))
                # Logged before the checkpoint: once θ_step is published the orchestrator moves on, and a run
                # stopped while the (slower) checkpoint is written must still have this step's metrics.
                if monitor is not None:
                    monitor.scalars(step, metrics)
                    for name, values in getattr(self, "histograms", {}).items():
                        monitor.histogram(step, name, values)
                log.info(
                    "step %d/%d loss %.4g grad_norm %.3g tok/s %.0f mfu %.2f%% mismatch_kl %.2e",
                    step,
                    max_steps,
                    metrics["loss"],
                    metrics["grad_norm"],
                    metrics["perf/tokens_per_s"],
                    100 * metrics["perf/mfu"],
                    metrics["mismatch_kl"],
                )
                self.maybe_checkpoint(step, final=step == max_steps)
                self.prune_consumed(step)
                last = step
        finally:
            self.checkpointer.close()
        if last > self.start_step:
            self.prune_consumed(last)  # again, now that the final (async) checkpoint has finished
        log.info("trainer done at step %d", last)
        return self.state


def distributed_settings(
    d: DistributedConfig, environ: Mapping[str, str] | None = None
) -> tuple[str, int, int]:
    """(coordinator address, process count, process id): the config, overridden per host by the environment.

    One resolved config serves every host of a multi-node run; each host sets its own `PRIMEJAX_PROCESS_ID`
    (and may set `PRIMEJAX_COORDINATOR_ADDRESS` / `PRIMEJAX_NUM_PROCESSES`) instead of editing it.
    """
    env = os.environ if environ is None else environ
    return (
        env.get("PRIMEJAX_COORDINATOR_ADDRESS", d.coordinator_address),
        int(env.get("PRIMEJAX_NUM_PROCESSES", d.num_processes)),
        int(env.get("PRIMEJAX_PROCESS_ID", d.process_id)),
    )


def maybe_init_distributed(d: DistributedConfig) -> None:
    address, num_processes, process_id = distributed_settings(d)
    if num_processes > 1:
        # CPU processes need a cross-process collectives backend (GPUs use NCCL, TPUs their ICI either way).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(address or None, num_processes=num_processes, process_id=process_id)


__all__: list[Any] = [
    "Trainer",
    "fake_batch",
    "build_model",
    "model_config",
    "NonFiniteError",
    "maybe_init_distributed",
]
