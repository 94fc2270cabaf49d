"""Context parallelism: one packed row's tokens split over the `context` mesh axis (Ulysses-style).

Outside attention every activation is split by token (`seq` -> `context` in the sharding rules), so the
embedding, norms, MLP and LM head run on T/C tokens per device with no communication of their own. Attention
needs every earlier token of a segment, so around it the layout switches from "tokens split" to "heads
split": q, k, v are constrained to whole rows with their heads split over `context` (`to_heads`), which XLA's
SPMD partitioner turns into one all-to-all per tensor, and the output goes back the same way (`to_tokens`).
Each device then runs the ordinary packed causal kernel (`attention.attention`: cuDNN on GPU, XLA on CPU) on
complete rows for H/C query heads and K/C kv heads: the segment ids, positions and causal mask are the
unsharded row's, so packing and segments that straddle the token split need no special case.

Why this and not ring attention or an all-gather of K/V (both keep queries split by token and visit key
blocks): on GPU the per-device work must go through cuDNN to be fast, and a query block that starts inside a
segment needs a causal mask aligned to the block's end (bottom-right) or a merge of per-block results by
their log-sum-exp. jax's cuDNN wrapper (jax 0.10-0.11) has only top-left causal alignment and drops the
cotangent of the log-sum-exp it can return, so both would need a hand-written backward over cuDNN's internal
primitives. The head split needs neither, is balanced by construction (every device does 1/C of the causal
work, no zig-zag reordering), and moves 4 * T * D / C elements per device per layer (q, k, v, out; k and v
are smaller under GQA), which NVLink carries in a few percent of the attention time at these lengths.

Limits: C must divide the query heads (with tensor parallelism, tensor * C must); when it does not divide the
kv heads they are replicated over the remainder (logical_to_spec), which stays correct. C must divide T.
The weights are sharded over `context` as well as `fsdp` (`embed` rule), so a 4-way context split of one
long row holds the same parameter and optimizer memory per device as 4-way FSDP.
"""

from __future__ import annotations

import jax

from primejax.models.sharding import axis_size, constrain, current_mesh


def context_size() -> int:
    """Devices the active mesh splits a row's tokens (the logical `seq` axis) over; 1 without a mesh."""
    return axis_size(current_mesh(), "seq")


def to_heads(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[B, T, H|K, Dh] split by token -> whole rows split by head (an all-to-all each under context > 1).

    Without context parallelism this is the same constraint as before: heads over `tensor`, rows whole.
    """
    q = constrain(q, ("batch", "attn_seq", "attn_heads", "head_dim"))
    k = constrain(k, ("batch", "attn_seq", "attn_kv_heads", "head_dim"))
    v = constrain(v, ("batch", "attn_seq", "attn_kv_heads", "head_dim"))
    return q, k, v


def to_tokens(o: jax.Array) -> jax.Array:
    """Attention's output [B, T, H, Dh] back to the token split of the rest of the layer."""
    return constrain(o, ("batch", "seq", "act_heads", "head_dim"))


def fold_context(x: jax.Array) -> jax.Array:
    """[B, T, ...] -> [B * C, T / C, ...]: each device's tokens of a row become a row of their own.

    For per-token work that loops over positions (the LM head's chunk scan): a loop over a dimension split
    over devices would make every device run every chunk; folded, the loop runs over each device's own
    tokens. Identity when C == 1 or C does not divide T.
    """
    c = context_size()
    b, t = x.shape[:2]
    if c == 1 or t % c:
        return x
    rest = x.shape[2:]
    y = x.reshape(b * c, t // c, *rest)
    return constrain(y, ("batch_context", None, *([None] * len(rest))))


def unfold_context(y: jax.Array, t: int) -> jax.Array:
    """Inverse of `fold_context` for a row length `t`."""
    c = context_size()
    if c == 1 or t % c:
        return y
    b = y.shape[0] // c
    x = y.reshape(b, t, *y.shape[2:])
    return constrain(x, ("batch", "seq", *([None] * (y.ndim - 2))))


def check_divisible(num_heads: int, tensor: int, context: int, seq_len: int | None = None) -> None:
    """One clear line for a layout context parallelism cannot split (instead of a silent full replication)."""
    if context <= 1:
        return
    if num_heads % (tensor * context):
        raise ValueError(
            f"trainer.mesh.context={context}: the model's {num_heads} query heads are not divisible by "
            f"tensor x context = {tensor * context}"
        )
    if seq_len is not None and seq_len % context:
        raise ValueError(f"trainer.mesh.context={context} must divide the row length {seq_len}")
