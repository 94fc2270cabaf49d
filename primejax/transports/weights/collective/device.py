"""The trainer's weights as HF tensors on the accelerator, handed to torch without a host copy (DLPack).

For each parameter (stacked over layers for the decoder's), one jitted function casts it to the wire dtype and
converts a run of layers to HF layout (the same converters as the safetensors export, primejax.models.hf_io),
gathering a sharded array's slice onto the sending device on device; `torch.from_dlpack` then views the
result and each layer is a contiguous slice of it. The run is the largest divisor of the layer count whose
converted output stays within `max_chunk_bytes` (one layer when even that is larger), so peak extra device
memory is one run plus one bucket, not a whole parameter: all 48 layers' experts of Qwen3-30B-A3B are 19 GB
per projection in bf16, which next to the trainer's state did not fit one GPU (docs/benchmarks.md, issue 33).

Single-process trainers only (one or several local devices: a sharded parameter is replicated over its mesh
by the jitted call and the sending device's copy is sent): a jax.Array sharded over several processes cannot
be gathered onto one device without a cross-process collective (transports/weights/shards.py sends row blocks instead).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from primejax.models.config import ModelConfig
from primejax.models.hf_io import hf_tensor_plan
from primejax.transports.weights.tensors import TensorMeta
from primejax.transports.weights.tensors import dlpack_to_torch as _to_torch

_CONVERTERS: dict[tuple, tuple[ModelConfig, Any, tuple]] = {}
MAX_CHUNK_BYTES = 1 << 30  # converted bytes per call: a few calls per parameter for an 8B model


def layers_per_call(layers: int, layer_bytes: int, max_chunk_bytes: int) -> int:
    """The largest divisor of `layers` whose run of converted layers is at most `max_chunk_bytes` (>= 1).
    A divisor, so every call has the same shape and the parameter compiles once."""
    fit = max(1, max_chunk_bytes // max(1, layer_bytes))
    return max(d for d in range(1, min(layers, fit) + 1) if layers % d == 0)


def _converter(
    to_hf: Any, cfg: ModelConfig, dtype: str, stacked: bool, device: Any, w: Any, run: int
) -> tuple[Any, tuple]:
    """(jitted cast + HF-layout conversion + gather onto `device`, its output shape per call), built once per
    parameter kind: a fresh jit (or shape trace) per round would cost more than sending a small model. Keyed
    on the config's identity (it may hold dicts), the input's shape and dtype and the layers per call. A
    stacked parameter's function takes (w, first layer) and converts `run` layers from there."""
    key = (to_hf, id(cfg), dtype, stacked, device, tuple(w.shape), str(w.dtype), run)
    if key not in _CONVERTERS:
        if stacked:

            def convert(w, start):
                w = jax.lax.dynamic_slice_in_dim(w, start, run).astype(jnp.dtype(dtype))
                return jax.vmap(lambda x: to_hf(x, cfg))(w)

            args = (w, 0)
        else:

            def convert(w):
                return to_hf(w.astype(jnp.dtype(dtype)), cfg)

            args = (w,)
        fn = jax.jit(convert, out_shardings=_output_sharding(w, device))
        _CONVERTERS[key] = (cfg, fn, tuple(jax.eval_shape(fn, *args).shape))
    return _CONVERTERS[key][1:]


def _output_sharding(w: Any, device: Any) -> Any:
    """On one device: that device. Sharded over several (a trainer's FSDP/tensor mesh in one process): replicated
    over the input's mesh, since one jitted computation may not put its output on a subset of its inputs'
    devices; `_on_device` then takes the sending device's copy (the gather runs on device, no host copy)."""
    sharding = getattr(w, "sharding", None)
    if sharding is None or len(sharding.device_set) == 1:
        return jax.sharding.SingleDeviceSharding(device)
    if device not in sharding.device_set:
        raise ValueError(
            f"the sending device {device} holds no part of the weights ({sorted(sharding.device_set)})"
        )
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())


def _on_device(x: Any, device: Any) -> Any:
    """`x`'s copy on `device` as a single-device array (itself when it lives there alone)."""
    if len(x.sharding.device_set) == 1:
        return x
    return next(s.data for s in x.addressable_shards if s.device == device)


def hf_device_tensors(
    model: Any, cfg: ModelConfig, dtype: str, device: Any = None, max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> tuple[list[TensorMeta], Iterator[Any]]:
    """(metadata of every HF tensor, a one-pass iterator of torch views of them on `device`), export order; an
    item covers one tensor, or several consecutive ones stacked on a leading axis (one call's run)."""
    device = device or jax.local_devices()[0]
    itemsize = jnp.dtype(dtype).itemsize
    steps = []
    metas: list[TensorMeta] = []
    for var, names, to_hf, per_slice in hf_tensor_plan(model, cfg):
        w = var[...]
        stacked = names[0].startswith("model.layers.")
        layers = w.shape[0] if stacked else 1
        # HF layout keeps the element count, so one layer converts to as many bytes as it holds elements.
        run = layers_per_call(layers, (w.size // layers) * itemsize, max_chunk_bytes) if stacked else 1
        fn, shape = _converter(to_hf, cfg, dtype, stacked, device, w, run)
        per = shape[(1 if stacked else 0) + (1 if per_slice > 1 else 0) :]
        metas += [TensorMeta(n, dtype, tuple(int(d) for d in per)) for n in names]
        steps.append((fn, var, names, per, stacked, layers, run))

    def tensors() -> Iterator[Any]:
        for fn, var, names, per, stacked, layers, run in steps:
            calls = [(start,) for start in range(0, layers, run)] if stacked else [()]
            per_call = len(names) // len(calls)
            for args in calls:
                out = _on_device(fn(var[...], *args), device)
                out.block_until_ready()  # ready before torch's stream reads it
                # One item for the run: its layers (x experts) stacked, a view; the wire takes it whole
                # (wire._blocks), so 18,432 expert tensors are 72 items, not one each.
                yield _to_torch(out).reshape(per_call, *per) if per_call > 1 else _to_torch(out).reshape(per)
                del out

    return metas, tensors()
