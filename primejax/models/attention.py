"""Causal self-attention over packed rows, behind one function with several kernels.

A row packs several samples; `segment_ids` says which sample each token belongs to (0 = padding). A token
attends to earlier-or-equal tokens of its own segment only. Causality is by index in the row: packing keeps
each sample contiguous and in order, so index order equals position order within a segment.

Implementations (`impl`):
- "xla": plain einsums with a dense [T, T] mask; portable reference, O(T^2) memory.
- "cudnn": cuDNN fused flash attention, GPU (Hopper or newer), bf16/fp16 only, in cuDNN's packed (THD,
  "ragged") mode: each row's segments become (offset, length) pairs and the kernel runs causal attention
  inside each one, skipping every cross-segment block. The public `jax.nn.dot_product_attention` has no
  segment argument (only per-row lengths, or a dense mask that cuDNN turns into an O(T^2) bias: 8 GiB per
  row at T=64k), so this goes through jax's cuDNN wrapper `jax._src.cudnn.fused_attention_stablehlo`
  (q_offsets / q_seqlen), checked against the xla path by tests/perf and tools/bench_trainer.py.
  Segments are maximal runs of equal ids (packing keeps samples contiguous), padding included; a row may
  hold at most `max_runs` runs, and a row with more gets NaN outputs rather than silently wrong ones.
  The run slots are a cost, not just a bound: cuDNN sizes its softmax statistics as [B * max_runs, H, T]
  and its backward pre-pass (dO.O, plus the fp32 dQ accumulator) works per slot over the whole row, so every
  slot costs time (docs/benchmarks.md measures it): callers that know how many
  samples a row packs say so (`runs_for_segments`), and a model describes the runs once per forward pass
  (`prepare_segments`) instead of once per layer. Rows of at most one sample (plus trailing padding) skip
  the packed mode: plain causal attention over the whole row is exact for every real token (padding comes
  after it, so causality already hides it), and cuDNN's plain causal kernel is faster than the packed one
  with 2 slots (docs/benchmarks.md).
- "splash": Pallas splash attention for TPU, with native segment ids and a causal block-sparse mask, run in
  shard_map under a mesh (models/splash_attention.py).
- "auto": cudnn on GPU, splash on TPU, xla elsewhere. The backend is the active mesh's platform when there
  is one (`jax.set_mesh`), so a step traced for TPU devices from a CPU host (tools/tpu_compile.py) gets the
  TPU kernel; else jax's default backend.
An unsupported combination (cudnn on CPU, fp32 cudnn, splash off TPU) falls back to xla with one warning.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

from primejax.models.precision import accumulating_einsum
from primejax.models.sharding import current_mesh
from primejax.models.splash_attention import splash_attention

logger = logging.getLogger(__name__)
# Runs of equal segment ids (samples, plus trailing padding) a packed row may hold on the cudnn path when the
# caller gives no bound. cuDNN does work for every slot, so this is a cost knob, not just a bound.
DEFAULT_MAX_RUNS = 64
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def resolve_impl(impl: str, dtype: jnp.dtype, backend: str | None = None) -> str:
    """The implementation that will actually run for `impl` on this backend and dtype."""
    backend = backend or _mesh_platform() or jax.default_backend()
    if impl == "auto":
        impl = {"gpu": "cudnn", "cuda": "cudnn", "tpu": "splash"}.get(backend, "xla")
        if impl == "cudnn" and jnp.dtype(dtype) == jnp.float32:
            return "xla"  # fp32 compute is a debugging/parity setting: the exact path is the right one
    if impl == "cudnn":
        if backend not in ("gpu", "cuda"):
            _warn_once(f"attention_impl='cudnn' needs a GPU (backend is {backend!r}); using the xla path")
            return "xla"
        if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
            _warn_once(f"attention_impl='cudnn' needs bf16/fp16 inputs (got {jnp.dtype(dtype)}); using xla")
            return "xla"
    elif impl == "splash" and backend != "tpu":
        _warn_once(f"attention_impl='splash' needs a TPU (backend is {backend!r}); using the xla path")
        return "xla"
    elif impl not in ("xla", "cudnn", "splash"):
        raise ValueError(f"unknown attention implementation {impl!r}")
    return impl


def _mesh_platform() -> str | None:
    mesh = current_mesh()
    device = getattr(mesh, "abstract_device", None) if mesh is not None else None
    return getattr(device, "platform", None)


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T, T] boolean: query t may attend key s (same segment and s <= t)."""
    t = segment_ids.shape[-1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return same & jnp.tril(jnp.ones((t, t), dtype=bool))[None]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array | None = None,
    *,
    impl: str = "xla",
    scale: float | None = None,
    max_runs: int = DEFAULT_MAX_RUNS,
    runs: SegmentRuns | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Packed causal GQA attention.

    q: [B, T, H, Dh]; k, v: [B, T, K, Dh] with H a multiple of K (v may be narrower: [B, T, K, Dv]);
    segment_ids: int32 [B, T]. Returns [B, T, H, Dv] in q's dtype. `positions` are not needed by any mask here (see module docstring)
    and are accepted so every kernel shares one signature. `interpret` runs Pallas kernels in interpreter
    mode (for tests off-TPU). cudnn only: `max_runs` bounds the runs of equal segment ids per row, and
    `runs` (from `prepare_segments`, computed once for all layers) replaces both that bound and the per-call
    run computation; with `runs` the caller owns the overflow flag (`SegmentRuns.overflow`), no NaN is
    written here.
    """
    del positions
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    impl = "splash" if interpret and impl == "splash" else resolve_impl(impl, q.dtype)
    if impl == "xla":
        return _xla_attention(q, k, v, segment_ids, scale)
    dv = v.shape[-1]
    if dv != q.shape[-1]:
        # Values narrower than queries/keys (multi-head latent attention: Dv 128 against Dn+Dr 192): the fused
        # kernels take one head width, so v is zero-padded to it and the padding's outputs dropped.
        if dv > q.shape[-1]:
            raise ValueError(f"value head width {dv} exceeds the query/key width {q.shape[-1]}")
        pad = [(0, 0)] * (v.ndim - 1) + [(0, q.shape[-1] - dv)]
        return attention(
            q,
            k,
            jnp.pad(v, pad),
            segment_ids,
            impl=impl,
            scale=scale,
            max_runs=max_runs,
            runs=runs,
            interpret=interpret,
        )[..., :dv]
    if impl == "cudnn":
        if runs is not None:
            return _cudnn_attention(q, k, v, runs, scale)
        runs = segment_runs(segment_ids, max(2, max_runs))
        out = _cudnn_attention(q, k, v, runs, scale)
        return jnp.where(runs.overflow[:, None, None, None], jnp.nan, out).astype(q.dtype)
    return splash_attention(q, k, v, segment_ids, scale, interpret=interpret)


def _xla_attention(q, k, v, segment_ids, scale):
    b, t, h, d = q.shape
    kv = k.shape[2]
    q_btkgd = q.reshape(b, t, kv, h // kv, d)
    # Scores and softmax in fp32 whatever the compute dtype, as flash kernels do.
    s_bkgts = accumulating_einsum("btkgd,bskd->bkgts", q_btkgd, k, jnp.float32) * scale
    mask_b11ts = segment_causal_mask(segment_ids)[:, None, None]
    # A finite floor instead of -inf: every row keeps its diagonal, and no NaN can appear even for padding.
    s_bkgts = jnp.where(mask_b11ts, s_bkgts, jnp.finfo(jnp.float32).min)
    p_bkgts = jax.nn.softmax(s_bkgts, axis=-1).astype(v.dtype)
    o_btkgd = jnp.einsum("bkgts,bskd->btkgd", p_bkgts, v)
    return o_btkgd.reshape(b, t, h, v.shape[-1]).astype(q.dtype)


class SegmentRuns(NamedTuple):
    """Each row's runs of equal segment ids, in the layout jax's cuDNN wrapper takes (see `segment_runs`).

    offsets/lengths None: every row holds at most one sample, padded at the end (`single_sample_rows`),
    and the kernel runs plain causal attention over the whole row.
    """

    offsets: jax.Array | None  # int32 [B, M+1]
    lengths: jax.Array | None  # int32 [B, M]
    overflow: jax.Array  # bool [B]: the row has more runs than described; its extra runs are not


def runs_for_segments(max_segments: int | None) -> int:
    """Run slots for rows of at most `max_segments` samples (None: unknown).

    Packing keeps each sample contiguous and puts the padding last, so a row of n samples has at most n + 1
    runs. Never fewer than 2: jax's wrapper treats one slot as "not packed".
    """
    if not max_segments:
        return DEFAULT_MAX_RUNS
    return max(2, int(max_segments) + 1)


def prepare_segments(
    segment_ids: jax.Array, *, impl: str, dtype: jnp.dtype, max_segments: int | None = None
) -> SegmentRuns | None:
    """The per-forward part of attention over these rows, computed once and shared by every layer.

    The run description on the cudnn path (None on the others, which work from `segment_ids` directly).
    `max_segments` bounds the samples (distinct non-zero ids) per row; see `runs_for_segments`.
    """
    if resolve_impl(impl, dtype) != "cudnn":
        return None
    if max_segments == 1:
        return single_sample_rows(segment_ids)
    return segment_runs(segment_ids, runs_for_segments(max_segments))


def single_sample_rows(segment_ids: jax.Array) -> SegmentRuns:
    """The description of rows that hold one sample followed by padding: plain causal attention.

    Exact for the sample's tokens (the padding after them is hidden by causality; what the padding itself
    attends to is never used). `overflow` flags rows that break the premise: a second run of non-padding
    ids, or padding before the sample.
    """
    starts_bt = segment_ids[:, 1:] != segment_ids[:, :-1]
    num_runs_b = 1 + jnp.sum(starts_bt, axis=1, dtype=jnp.int32)
    padding_first_b = (segment_ids[:, 0] == 0) & (num_runs_b > 1)
    return SegmentRuns(None, None, (num_runs_b > 2) | padding_first_b)


def segment_runs(segment_ids: jax.Array, max_runs: int) -> SegmentRuns:
    """(offsets [B, M+1], lengths [B, M], overflow [B]) of each row's runs of equal segment ids.

    In the layout jax's cuDNN wrapper takes: a row's run starts, then -1 for unused slots (offsets has one
    spare slot, as the wrapper expects); lengths -1 for unused slots. `overflow` flags rows with more than
    M = max_runs runs, whose extra runs are not described.
    """
    b, t = segment_ids.shape
    starts_bt = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    num_runs_b = jnp.sum(starts_bt, axis=1, dtype=jnp.int32)
    # Start indices of the first M+1 runs, padded with t: consecutive differences are the run lengths.
    idx_bm = jax.vmap(lambda s: jnp.nonzero(s, size=max_runs + 1, fill_value=t)[0])(starts_bt)
    idx_bm = idx_bm.astype(jnp.int32)
    slot = jnp.arange(max_runs + 1, dtype=jnp.int32)[None]
    offsets = jnp.where(slot < num_runs_b[:, None], idx_bm, -1)
    lengths = jnp.where(slot[:, :-1] < num_runs_b[:, None], idx_bm[:, 1:] - idx_bm[:, :-1], -1)
    return SegmentRuns(offsets, lengths, num_runs_b > max_runs)


def _cudnn_attention(q, k, v, runs: SegmentRuns, scale):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

    if runs.lengths is None:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
    if runs.lengths.shape[1] < 2:
        raise ValueError("cudnn packed attention needs at least 2 run slots (1 means 'not packed' to jax)")
    out = cudnn_fa.dot_product_attention(
        q,
        k,
        v,
        q_seqlen=runs.lengths,
        kv_seqlen=runs.lengths,
        q_offsets=runs.offsets,
        kv_offsets=runs.offsets,
        scale=scale,
        mask_type=cudnn_fa.MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH",
    )
    return out.astype(q.dtype)
