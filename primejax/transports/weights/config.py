"""`trainer.broadcast`: how the trainer's weights reach the inference servers (docs/weight_transfer.md).

The weight transports own their config section; the trainer's config composes it under `trainer.broadcast`.
Light on purpose (no JAX import): the launcher and `--help=keys` read it without starting a backend.
"""

from __future__ import annotations

from primejax.transports.weights.registry import UnknownTransport, lookup
from primejax.utils.sections import ConfigError, Section, option, section


@section
class BroadcastConfig(Section):
    """The weights to inference after every step: broadcasts/step_N on disk, or collective (docs/weight_transfer.md:
    sent through vLLM's weight-transfer engine; on disk only at checkpoint steps, after the orchestrator's last
    step, and when a transfer fails, the fallback)."""

    dtype: str = option("bfloat16", "stored / sent dtype", choices=("bfloat16", "float32"))
    hash: bool = option(True, "list the files' sha256 in STABLE")
    mode: str = option(
        "filesystem",
        "how weights reach the inference servers: a registered transport (filesystem, collective, or the "
        "name of a folder under primejax/transports/weights/ that registers itself)",
    )
    transfer_host: str = option(
        "127.0.0.1", "collective: address the trainer's rendezvous listens on (servers connect)"
    )
    transfer_port: int = option(0, "collective: rendezvous port; 0 = any free port", ge=0, le=65535)
    transfer_timeout_s: float = option(
        60.0,
        "collective: bound on each phase of a transfer before the fallback (at most a day)",
        gt=0,
        le=86400,
    )
    bucket_mb: int = option(256, "collective: packed bucket size (MiB)", gt=0)
    max_shard_mb: float = option(
        5120.0, "safetensors file size; with several trainer processes each writes its share of files", gt=0
    )
    lora: str = option(
        "adapter",
        "with model.lora: 'adapter' publishes the adapter alone (PEFT dir; the server loads it by version name, "
        "docs/lora.md), 'merged' the merged full weights",
        choices=("adapter", "merged"),
    )
    export: str = option(
        "parallel",
        "filesystem export: parallel = each process writes its own row blocks into the files (threads, pwrite); "
        "gather = each tensor gathered to the host and whole files written (docs/weight_transfer.md)",
        choices=("parallel", "gather"),
    )
    export_threads: int = option(8, "parallel export: writer threads per process", gt=0)
    workers_per_server: int = option(
        1,
        "collective: inference workers per server (its tensor- x pipeline-parallel size); each one receives",
        gt=0,
    )

    def check(self) -> None:
        try:
            lookup(self.mode)
        except UnknownTransport as e:
            raise ConfigError("mode", str(e)) from None
