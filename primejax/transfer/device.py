"""The trainer's weights as HF tensors on the accelerator, handed to torch without a host copy (DLPack).

For each parameter (stacked over layers for the decoder's), one jitted function casts it to the wire dtype and
converts every layer to HF layout at once (the same converters as the safetensors export,
primejax.models.hf_io), gathering a sharded array onto the sending device on device; `torch.from_dlpack`
then views the result and each layer is a contiguous slice of it. Peak extra device memory is one converted
parameter (e.g. all layers' gate_proj) plus one bucket.

Single-process trainers only: a jax.Array sharded over several processes cannot be gathered onto one
device without a cross-process collective (the filesystem export gathers those through the host).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from primejax.models.config import ModelConfig
from primejax.models.hf_io import hf_tensor_plan
from primejax.transfer.wire import TensorMeta

_CONVERTERS: dict[tuple, tuple[ModelConfig, Any, tuple]] = {}


def _converter(
    to_hf: Any, cfg: ModelConfig, dtype: str, stacked: bool, device: Any, w: Any
) -> tuple[Any, tuple]:
    """(jitted cast + HF-layout conversion + gather onto `device`, its output shape), built once per parameter
    kind: a fresh jit (or shape trace) per round would cost more than sending a small model. Keyed on the
    config's identity (it may hold dicts) and the input's shape and dtype."""
    key = (to_hf, id(cfg), dtype, stacked, device, tuple(w.shape), str(w.dtype))
    if key not in _CONVERTERS:

        def convert(w):
            w = w.astype(jnp.dtype(dtype))
            return jax.vmap(lambda x: to_hf(x, cfg))(w) if stacked else to_hf(w, cfg)

        fn = jax.jit(convert, out_shardings=jax.sharding.SingleDeviceSharding(device))
        _CONVERTERS[key] = (cfg, fn, tuple(jax.eval_shape(fn, w).shape))
    return _CONVERTERS[key][1:]


def _to_torch(x: Any) -> Any:
    import torch

    try:
        return torch.from_dlpack(x)
    except (TypeError, BufferError):  # an exporter that refuses torch's stream argument: the plain capsule
        return torch.from_dlpack(x.__dlpack__())


def hf_device_tensors(
    model: Any, cfg: ModelConfig, dtype: str, device: Any = None
) -> tuple[list[TensorMeta], Iterator[Any]]:
    """(metadata of every HF tensor, a one-pass iterator of torch views of them on `device`), export order."""
    device = device or jax.local_devices()[0]
    steps = []
    metas: list[TensorMeta] = []
    for var, names, to_hf, per_slice in hf_tensor_plan(model, cfg):
        stacked = names[0].startswith("model.layers.")
        fn, shape = _converter(to_hf, cfg, dtype, stacked, device, var[...])
        per = shape[(1 if stacked else 0) + (1 if per_slice > 1 else 0) :]
        metas += [TensorMeta(n, dtype, tuple(int(d) for d in per)) for n in names]
        steps.append((fn, var, names, per))

    def tensors() -> Iterator[Any]:
        for fn, var, names, per in steps:
            out = fn(var[...])
            out.block_until_ready()  # ready before torch's stream reads it
            t = _to_torch(out).reshape(len(names), *per)  # a view: layers (x experts) are contiguous slices
            yield from (t[i] for i in range(len(names)))
            del out, t

    return metas, tensors()
