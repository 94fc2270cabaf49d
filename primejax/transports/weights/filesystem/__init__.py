"""The filesystem transport: broadcasts/step_N (HF safetensors + STABLE), written by the trainer, loaded by path.

Registered as `trainer.broadcast.mode = "filesystem"` (registry.py); its server side is the built-in
`/update_weights` route."""

from primejax.transports.weights.registry import Transport, register


def _publisher(ctx):  # the disk publisher alone (a LoRA run's is the adapter directory)
    return ctx.disk()


TRANSPORT = register(Transport("filesystem", _publisher, doc="broadcasts/step_N on disk, loaded by path"))
