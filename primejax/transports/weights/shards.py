"""The HF tensors as row blocks held where the trainer's devices hold them: what each process sends or writes.

A multi-process trainer never gathers a tensor onto one process (docs/weight_transfer.md, "Several senders").
For each parameter one jitted function casts it to the wire dtype, converts every layer to HF layout (the
converters of the safetensors export, primejax.models.hf_io) and lays the result out split by rows (dim 0 of
each HF tensor) over every device of the parameter's mesh: XLA moves the data device to device (an
all-to-all), nothing goes through one host. Each device then holds one contiguous row block of every HF
tensor, and its process sends (or writes into the safetensors file, at the block's offset) the blocks of its
own devices. A tensor whose row count does not split evenly over the devices is kept whole (replicated) and
sent by one process, picked round-robin over the tensors.

`Piece` (tensor index, sending process, first row, end row) is the unit of the wire's multi-sender schedule
(primejax.transports.weights.collective.lanes) and of the parallel export (primejax.transports.weights.filesystem.export); every process computes the
same list of pieces from shapes and shardings alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from primejax.models.config import ModelConfig
from primejax.models.hf_io import export_dtype, hf_tensor_plan, param_variables
from primejax.transports.weights.tensors import Piece, TensorMeta, dlpack_to_torch

_CONVERTERS: dict[tuple, Any] = {}


def _converter(to_hf: Any, cfg: ModelConfig, dtype: str, stacked: bool, out_sharding: Any, w: Any) -> Any:
    """The jitted cast + HF-layout conversion, built once per parameter kind (keyed as transports/weights/collective/device.py's)."""
    key = (to_hf, id(cfg), dtype, stacked, out_sharding, tuple(w.shape), str(w.dtype), w.sharding)
    if key not in _CONVERTERS:

        def convert(w):
            w = w.astype(jnp.dtype(dtype))
            return jax.vmap(lambda x: to_hf(x, cfg))(w) if stacked else to_hf(w, cfg)

        _CONVERTERS[key] = (cfg, jax.jit(convert, out_shardings=out_sharding))
    return _CONVERTERS[key][1]


@dataclass
class _Param:
    var: Any
    names: list[str]
    fn: Any
    lead: int  # leading axes before the HF tensor's own (layers, experts x gate/up)
    shape: tuple[int, ...]  # the converted array's full shape
    split: bool  # rows split over the devices (else replicated, one owner)
    sharding: Any  # the converted array's sharding (None: the input's single device)
    owner: int  # the sending process of a replicated parameter
    first: int  # index of its first tensor in the round's list


class RowShards:
    """The model's HF tensors as this process's row blocks (module docstring). Build once per round."""

    def __init__(self, model: Any, cfg: ModelConfig, dtype: str):
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.metas: list[TensorMeta] = []
        self.params: list[_Param] = []
        ours = list(param_variables(model))
        for k, (var, names, to_hf, per_slice) in enumerate(hf_tensor_plan(model, cfg)):
            w = var[...]
            d = export_dtype(ours[k], dtype)
            stacked = names[0].startswith("model.layers.")
            lead = (1 if stacked else 0) + (1 if per_slice > 1 else 0)
            shape = tuple(
                int(x) for x in jax.eval_shape(_converter(to_hf, cfg, d, stacked, None, w), w).shape
            )
            mesh = w.sharding.mesh if isinstance(w.sharding, NamedSharding) else None
            n = 1 if mesh is None else mesh.size
            split = mesh is not None and len(shape) > lead and shape[lead] % n == 0 and n > 1
            if mesh is None:
                out = None
            elif split:  # rows over every mesh axis at once (no axis named: the mesh's own tuple)
                out = NamedSharding(mesh, PartitionSpec(*([None] * lead), tuple(mesh.axis_names)))
            else:
                out = NamedSharding(mesh, PartitionSpec())
            fn = _converter(to_hf, cfg, d, stacked, out, w)
            per = shape[lead:]
            self.params.append(
                _Param(var, names, fn, lead, shape, split, out, k % self.processes, len(self.metas))
            )
            self.metas += [TensorMeta(name, d, per) for name in names]

    def pieces(self) -> list[Piece]:
        """Every process's pieces, in send order: per parameter, per tensor, by first row (identical everywhere)."""
        out: list[Piece] = []
        for p in self.params:
            rows = p.shape[p.lead] if len(p.shape) > p.lead else 1
            if not p.split:
                out += [Piece(p.first + i, p.owner, 0, rows) for i in range(len(p.names))]
                continue
            blocks = sorted(
                {
                    (idx[p.lead].start or 0, idx[p.lead].stop or rows, dev.process_index)
                    for dev, idx in p.sharding.devices_indices_map(p.shape).items()
                }
            )
            for i in range(len(p.names)):
                out += [Piece(p.first + i, proc, a, b) for a, b, proc in blocks]
        return out

    def local(self, host: bool = False) -> Iterator[tuple[Piece, Any]]:
        """This process's pieces in `pieces()` order, each with its rows: a numpy view (CPU) or a torch view of
        the device buffer (GPU, DLPack); `host`: always numpy (an accelerator shard copied to the host once).
        One converted parameter is alive at a time."""
        view = (lambda x: np.asarray(x)) if host else _view
        for p in self.params:
            rows = p.shape[p.lead] if len(p.shape) > p.lead else 1
            if not p.split and p.owner != self.process:
                continue
            out = p.fn(p.var[...])
            if not p.split:
                local = view(out.addressable_shards[0].data)
                flat = local.reshape(len(p.names), *p.shape[p.lead :])
                for i in range(len(p.names)):
                    yield Piece(p.first + i, self.process, 0, rows), flat[i]
                del out, local, flat
                continue
            mine = {}
            for shard in out.addressable_shards:
                if shard.replica_id == 0:
                    sl = shard.index[p.lead]
                    mine[(sl.start or 0, sl.stop or rows)] = view(shard.data)
            for i in range(len(p.names)):
                lead_idx = tuple(int(j) for j in np.unravel_index(i, p.shape[: p.lead])) if p.lead else ()
                for (a, b), data in sorted(mine.items()):
                    yield Piece(p.first + i, self.process, a, b), data[lead_idx]
            del out, mine


def _view(x: jax.Array) -> Any:
    """A CPU shard as a numpy view (no copy); an accelerator shard as a torch view of its device buffer (DLPack,
    ready first: torch's stream reads it). Indexing either yields views, each a contiguous row block."""
    if next(iter(x.devices())).platform == "cpu":
        return np.asarray(x)
    x.block_until_ready()
    return dlpack_to_torch(x)
