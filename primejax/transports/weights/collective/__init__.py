"""The collective transport: tensors straight from the trainer into the servers (gloo / NCCL), over an
authenticated rendezvous; the disk copy only where one is needed.

Registered as `trainer.broadcast.mode = "collective"` (registry.py); its server side is the built-in
`/transfer_weights` route and vLLM's weight-transfer engine (receiver.py)."""

from primejax.transports.weights.registry import Transport, register


def _publisher(ctx):
    from primejax.transports.weights.collective.publisher import CollectivePublisher

    receivers = ctx.num_receivers
    if ctx.adapters:  # an adapter round goes to each server's API process, one per server
        receivers = max(1, receivers // ctx.broadcast.workers_per_server)
    return CollectivePublisher(
        ctx.disk(),
        num_receivers=receivers,
        checkpoint_interval=ctx.checkpoint_interval,
        last_sampled_step=ctx.max_steps - 1 - ctx.async_level,
    )


TRANSPORT = register(
    Transport("collective", _publisher, doc="straight into the servers' workers; disk only where needed")
)
