"""Host-offloaded optimizer state: fp32 master weights and AdamW moments in pinned host memory (`trainer.optim.offload`).

With offload on, the `TrainState` keeps its `params` on the devices in `model.param_dtype` (the compute copy the
forward and backward read: bf16 for the memory saving) and its `opt_state` in host memory:

    opt_state = {"master": (bucket_0, bucket_1, ...), "opt": (adamw_state_0, adamw_state_1, ...)}

Each bucket is a pruned copy of the parameter tree (same nested names, so the weight-decay mask still reads each
parameter's own name) holding fp32 master values of some parameters, or of a slice of a stacked parameter along
its unsharded leading (layer) axis; its AdamW state is AdamW's own over that bucket. The step computes fp32
gradients on the devices, clips them by the global norm once, then for each bucket in turn: the bucket's master
and moments come to the devices, AdamW updates them, they go back to host memory and the bucket's new compute copy
(master cast to `model.param_dtype`) stays on the devices. An optimization barrier ties each bucket's transfer to
the result of the bucket `offload_inflight` places back (default 1: the previous one), so at most about that many
buckets of fp32 state (3 x `offload_bucket_mb` per device each) are on a device at a time instead of all of it.
With 2 in flight a bucket's copy to the devices may run beside the previous bucket's copy back; on 2 x H200 it did
not shorten the update, which the host link bounds (below; docs/benchmarks_log.md).

`offload_master` False keeps the fp32 master on the devices (4 B/param there) and moves only the moments: 8 of the
12 bytes per parameter cross PCIe each way per step. `offload_resident_gib` keeps whole buckets' state (master and
moments) on the devices, the first buckets, up to that many GiB per device of what would otherwise rest in host
memory: the memory the offload freed for activations is spent back on state that then never crosses PCIe. Each
resident GiB saves 2 GiB of copies per step, as the master on the devices does, at any size instead of all or
nothing. The host link is the bound: per GPU, one direction runs at ~54 GB/s and both at once at ~67 GB/s in all
with two GPUs copying (tools/bench_host_copies.py of adbf550, docs/benchmarks_log.md), so every GB of state left
in host memory costs ~30 ms per step.

Equal to the on-device update: the same clip and AdamW operations on the same fp32 values. With
`model.param_dtype` float32 (compute copy = master) and one bucket the parameters and moments are bit-identical to
the default path's; with several buckets XLA fuses each bucket's update separately and may contract a multiply-add
differently, an ulp apart per step (tests/trainer/test_offload.py). With bfloat16 compute copies the master and moments stay
fp32, as in mixed-precision training. The non-finite guard: a non-finite loss or gradient skips the whole update
(as on device); a bucket whose own new values overflow is kept unchanged and the step reports `nonfinite` = 1
(undoing buckets already written back would need a second copy of the host state). docs/memory.md has the
memory and transfer costs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

HOST = "pinned_host"
DEVICE = "device"
MASTER_DTYPE = jnp.float32


def _key(k: Any) -> Any:
    if not isinstance(k, jax.tree_util.DictKey):
        raise TypeError(f"offload needs a tree of nested dicts, found path entry {k!r}")
    return k.key


def _per_device_bytes(shape: tuple[int, ...], sharding: NamedSharding) -> int:
    return math.prod(sharding.shard_shape(shape)) * jnp.dtype(MASTER_DTYPE).itemsize


def _leading_unsharded(sharding: NamedSharding, ndim: int) -> bool:
    spec = tuple(sharding.spec) + (None,) * ndim
    return ndim >= 1 and spec[0] is None


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of parameter `leaf` along axis 0 (or all of it: `stop` is None)."""

    leaf: int
    start: int = 0
    stop: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which (slices of) parameters each bucket holds, and their shardings (device memory)."""

    paths: tuple[tuple[Any, ...], ...]  # each parameter's dict keys
    shapes: tuple[tuple[int, ...], ...]
    shardings: tuple[NamedSharding, ...]
    buckets: tuple[tuple[Piece, ...], ...]

    def piece_shape(self, p: Piece) -> tuple[int, ...]:
        shape = self.shapes[p.leaf]
        return shape if p.stop is None else (p.stop - p.start, *shape[1:])

    def tree(self, bucket: int, values: list[Any]) -> dict:
        """The bucket's pruned parameter tree holding `values` (one per piece)."""
        out: dict = {}
        for p, v in zip(self.buckets[bucket], values, strict=True):
            *parents, last = self.paths[p.leaf]
            node = out
            for k in parents:
                node = node.setdefault(k, {})
            node[last] = v
        return out

    def bucket_bytes(self, bucket: int) -> int:
        """Per-device bytes of the bucket's fp32 master values."""
        return sum(
            _per_device_bytes(self.piece_shape(p), self.shardings[p.leaf]) for p in self.buckets[bucket]
        )

    def values(self, bucket: int, tree: dict) -> list[Any]:
        """The bucket's piece values back from its pruned tree."""
        out = []
        for p in self.buckets[bucket]:
            node = tree
            for k in self.paths[p.leaf]:
                node = node[k]
            out.append(node)
        return out


def assemble(plan: Plan, trees: Any, treedef: Any) -> Any:
    """One full parameter tree of host arrays from each bucket's pruned tree (`trees[k]`, bucket k's master or one
    of its moments): a split parameter's slices joined along axis 0. For checks and tools; the step never needs it."""
    parts: dict[int, list[tuple[int, np.ndarray]]] = {}
    for k, tree in enumerate(trees):
        for p, v in zip(plan.buckets[k], plan.values(k, tree), strict=True):
            parts.setdefault(p.leaf, []).append((p.start, np.asarray(jax.device_get(v))))
    leaves = [
        np.concatenate([v for _, v in sorted(parts[i], key=lambda t: t[0])]) for i in range(len(plan.paths))
    ]
    return jax.tree.unflatten(treedef, leaves)


def make_plan(params: Any, bucket_bytes: int) -> Plan:
    """Buckets of about `bucket_bytes` per device of fp32 master values, in parameter order; a parameter larger than
    a bucket is split along its leading axis when that axis is not sharded (stacked layers)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    paths = tuple(tuple(_key(k) for k in path) for path, _ in flat)
    shapes = tuple(tuple(x.shape) for _, x in flat)
    shardings = tuple(x.sharding.with_memory_kind(DEVICE) for _, x in flat)
    pieces: list[tuple[Piece, int]] = []
    for i, (shape, sh) in enumerate(zip(shapes, shardings, strict=True)):
        size = _per_device_bytes(shape, sh)
        n = min(-(-size // bucket_bytes), shape[0]) if _leading_unsharded(sh, len(shape)) else 1
        if n <= 1:
            pieces.append((Piece(i), size))
            continue
        bounds = [shape[0] * j // n for j in range(n + 1)]
        pieces += [
            (Piece(i, a, b), size * (b - a) // shape[0]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    buckets: list[list[Piece]] = []
    used = bucket_bytes  # start a first bucket
    for piece, size in pieces:
        if used + size > bucket_bytes or any(q.leaf == piece.leaf for q in buckets[-1]):
            buckets.append([])
            used = 0
        buckets[-1].append(piece)
        used += size
    return Plan(paths, shapes, shardings, tuple(tuple(b) for b in buckets))


def _to(tree: Any, shardings: Any, kind: str) -> Any:
    return jax.device_put(tree, jax.tree.map(lambda s: s.with_memory_kind(kind), shardings))


@dataclasses.dataclass(frozen=True)
class Offload:
    """The offloaded update of `clip` (global, or None) then `inner` (elementwise, e.g. AdamW) over `plan`."""

    plan: Plan
    clip: optax.GradientTransformation | None
    inner: optax.GradientTransformation
    mesh: Mesh
    master_kind: str = HOST  # where the fp32 master rests between steps (DEVICE: only the moments travel)
    inflight: int = 1  # buckets whose transfers may run at once
    resident: tuple[
        bool, ...
    ] = ()  # per bucket: its whole state rests on the devices (no transfers); () = none

    def _resident(self, k: int) -> bool:
        return bool(self.resident) and self.resident[k]

    def _kinds(self, k: int) -> tuple[str, str]:
        """Where bucket k's (master, moments) rest between steps."""
        return (DEVICE, DEVICE) if self._resident(k) else (self.master_kind, HOST)

    # -------------------------------------------------------------------------------------- layout

    def _bucket_master_sds(self, k: int) -> dict:
        return self.plan.tree(
            k,
            [
                jax.ShapeDtypeStruct(
                    self.plan.piece_shape(p), MASTER_DTYPE, sharding=self.plan.shardings[p.leaf]
                )
                for p in self.plan.buckets[k]
            ],
        )

    def shardings(self, kind: str = HOST) -> dict:
        """The opt_state's NamedShardings: where it rests between steps (the moments in pinned host memory, the
        master where `master_kind` says), or all on the devices for the update (`kind` "device")."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        masters, opts = [], []
        for k in range(len(self.plan.buckets)):
            master_kind, opt_kind = (DEVICE, DEVICE) if kind == DEVICE else self._kinds(k)
            master = self._bucket_master_sds(k)
            masters.append(jax.tree.map(lambda s, m=master_kind: s.sharding.with_memory_kind(m), master))
            shape = jax.eval_shape(self.inner.init, master)
            opts.append(
                optax.tree_map_params(
                    self.inner,
                    lambda _, s, o=opt_kind: s.sharding.with_memory_kind(o),
                    shape,
                    master,
                    transform_non_params=lambda _, o=opt_kind: replicated.with_memory_kind(o),
                )
            )
        return {"master": tuple(masters), "opt": tuple(opts)}

    def abstract(self) -> dict:
        """The opt_state as ShapeDtypeStructs carrying their (host) shardings."""
        shapes = {
            "master": tuple(self._bucket_master_sds(k) for k in range(len(self.plan.buckets))),
        }
        shapes["opt"] = tuple(jax.eval_shape(self.inner.init, m) for m in shapes["master"])
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, self.shardings()
        )

    def init(self, params: Any) -> dict:
        """The host opt_state for concrete `params`: fp32 master copies and fresh AdamW state per bucket, built
        one bucket per compiled call (so no device ever holds more than one bucket of fp32 state)."""
        leaves = jax.tree.leaves(params)
        host = self.shardings()
        masters, opts = [], []
        # one compiled builder per bucket layout: the slices of one stacked parameter share theirs (a 48-layer
        # MoE has tens of buckets but a handful of layouts, and each compile costs seconds on a GPU); a slice's
        # start is an argument, so the slicing runs inside the builder
        builders: dict[tuple, Any] = {}
        for k, bucket in enumerate(self.plan.buckets):
            # the resting place is part of the key: out_shardings carry it (a resident bucket's builder puts its
            # state on the devices, and must not serve a same-shaped bucket that rests in host memory)
            layout = (tuple((p.leaf, self.plan.piece_shape(p)) for p in bucket), self._kinds(k))
            if layout not in builders:

                def build(xs, starts, k=k, bucket=bucket):
                    parts = [
                        x if p.stop is None else jax.lax.dynamic_slice_in_dim(x, s, p.stop - p.start)
                        for x, s, p in zip(xs, starts, bucket, strict=True)
                    ]
                    master = self.plan.tree(k, [x.astype(MASTER_DTYPE) for x in parts])
                    return master, self.inner.init(master)

                builders[layout] = jax.jit(build, out_shardings=(host["master"][k], host["opt"][k]))
            with jax.set_mesh(self.mesh):
                master, opt = builders[layout](
                    [leaves[p.leaf] for p in bucket], [np.int32(p.start) for p in bucket]
                )
            masters.append(master)
            opts.append(opt)
        return {"master": tuple(masters), "opt": tuple(opts)}

    @staticmethod
    def _slice(x: jax.Array, p: Piece) -> jax.Array:
        return x if p.stop is None else x[p.start : p.stop]

    # -------------------------------------------------------------------------------------- the update

    def update(
        self, grads: Any, opt_state: dict, params: Any, finite: jax.Array
    ) -> tuple[Any, dict, jax.Array]:
        """(params, opt_state, ok) after one streamed update (inside the jitted step); see the module docstring."""
        if self.clip is not None:
            grads, _ = self.clip.update(grads, self.clip.init(grads))
        g_leaves, treedef = jax.tree.flatten(grads)
        p_leaves = jax.tree.leaves(params)
        dev = self.shardings(DEVICE)
        pieces: dict[int, list[tuple[int, jax.Array]]] = {}
        masters, opts, ok_all, done, computes = [], [], finite, [], []
        for k, bucket in enumerate(self.plan.buckets):
            host = (opt_state["master"][k], opt_state["opt"][k])
            moves = not self._resident(k)  # a resident bucket has no transfer to order: it may run any time
            if (
                moves and len(done) >= self.inflight
            ):  # the transfer waits for the result `inflight` moving buckets back
                host, _ = jax.lax.optimization_barrier((host, done[-self.inflight]))
            master, state = _to(host, (dev["master"][k], dev["opt"][k]), DEVICE)
            g = self.plan.tree(k, [self._slice(g_leaves[p.leaf], p).astype(MASTER_DTYPE) for p in bucket])
            updates, new_state = self.inner.update(g, state, master)
            new_master = optax.apply_updates(master, updates)
            ok = finite & _all_finite(new_master) & _all_finite(new_state)
            new_master, new_state = _where(ok, (new_master, new_state), (master, state))
            # one materialized result for both consumers (the host copy and the compute copy): XLA would otherwise
            # duplicate the elementwise update into each, and each fusion may round differently (FMA contraction)
            new_master, new_state = jax.lax.optimization_barrier((new_master, new_state))
            ok_all = ok_all & ok
            # back to host memory now, not after the loop: every bucket's result would be on the device at once
            master_kind, opt_kind = self._kinds(k)
            host_master = _to(new_master, dev["master"][k], master_kind)
            host_state = _to(new_state, dev["opt"][k], opt_kind)
            masters.append(host_master)
            opts.append(host_state)
            compute = [
                v.astype(p_leaves[p.leaf].dtype)
                for p, v in zip(bucket, self.plan.values(k, new_master), strict=True)
            ]
            computes.append(compute)
            if moves:
                done.append(compute)
        for bucket, compute in zip(self.plan.buckets, computes, strict=True):
            for p, v in zip(bucket, compute, strict=True):
                pieces.setdefault(p.leaf, []).append((p.start, v))
        new_opt = {"master": tuple(masters), "opt": tuple(opts)}
        new_leaves = []
        for i in range(len(p_leaves)):
            parts = [v for _, v in sorted(pieces[i], key=lambda t: t[0])]
            new_leaves.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))
        new_params = jax.tree.unflatten(treedef, new_leaves)
        new_params = jax.lax.with_sharding_constraint(
            new_params, jax.tree.unflatten(treedef, self.plan.shardings)
        )
        return new_params, new_opt, ok_all


def host_bytes_per_param(master_on_host: bool) -> int:
    """Pinned host memory per parameter: two fp32 moments, and the fp32 master unless it stays on the devices."""
    return (3 if master_on_host else 2) * jnp.dtype(MASTER_DTYPE).itemsize


def _gib_bytes(gib: float) -> int:
    return int(gib * 2**30)


def host_state_bytes(num_params: int, devices: int, *, master_on_host: bool, resident_gib: float) -> int:
    """Pinned host memory the offloaded state of `num_params` parameters takes over `devices` devices:
    `host_bytes_per_param` each, less the `resident_gib` each device keeps (whole buckets up to it, so this is low
    by less than a bucket per device)."""
    total = host_bytes_per_param(master_on_host) * num_params
    return max(0, total - _gib_bytes(resident_gib) * devices)


def _where(pred: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def make_offload(
    params: Any,
    clip: optax.GradientTransformation | None,
    inner: optax.GradientTransformation,
    mesh: Mesh,
    bucket_mb: float,
    *,
    master_on_host: bool = True,
    inflight: int = 1,
    resident_gib: float = 0.0,
) -> Offload:
    """The offload of `params` (arrays or ShapeDtypeStructs with NamedShardings on `mesh`); `resident_gib` per
    device of the state that would rest in host memory stays on the devices instead, whole buckets from the first."""
    plan = make_plan(params, max(1, int(bucket_mb * 2**20)))
    per_master_byte = host_bytes_per_param(master_on_host) // jnp.dtype(MASTER_DTYPE).itemsize
    budget, resident, used = _gib_bytes(resident_gib), [], 0
    for k in range(len(plan.buckets)):
        used += per_master_byte * plan.bucket_bytes(k)
        resident.append(used <= budget and all(resident))
    return Offload(
        plan, clip, inner, mesh, HOST if master_on_host else DEVICE, max(1, inflight), tuple(resident)
    )


__all__ = ["HOST", "Offload", "Plan", "host_bytes_per_param", "host_state_bytes", "make_offload", "make_plan"]
