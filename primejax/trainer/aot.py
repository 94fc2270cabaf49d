"""Ahead-of-time compilation of the trainer's real step for devices this process need not have.

`compile_train_step` builds the trainer's own engine (trainer/engine.py: model graph, optimizer, loss, remat
policy, mesh and the jitted step with the state's shardings pinned) in its abstract form — the state as
`jax.ShapeDtypeStruct`s carrying `NamedSharding`s instead of weights, so no parameter is ever allocated. Given TPU devices from a topology description
(`jax.experimental.topologies.get_topology_desc`), XLA compiles the step for that TPU slice on a CPU host,
and the compiled executable reports per-device memory and FLOPs (tools/tpu_compile.py, docs/tpu.md). The
mesh plans that tool tries (`recommend_meshes`) and their checks are here, next to the step they compile.
The attention kernel follows the mesh's platform (`attention.resolve_impl`), so "auto" compiles the TPU
splash kernel here.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Sequence
from typing import Any

import jax

from primejax.models.config import ModelConfig
from primejax.models.remat import resolve_remat_policy
from primejax.trainer.engine import Engine
from primejax.trainer.step import dp_size


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """Per-device figures of one compiled step (bytes, FLOPs) and what was compiled."""

    mesh: dict[str, int]
    remat_policy: str  # as resolved for the micro-batch ("auto" picks by size)
    attention_impl: str  # as configured; the kernel that ran is the mesh platform's
    micro_batches: int
    rows: int  # global rows per micro-batch
    seq_len: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse donated argument buffers (the state)
    temp_bytes: int
    generated_code_bytes: int
    flops: float  # per device, as compiled (remat recompute included); 0 when out of memory
    estimated_seconds: float | None  # the compiler's cost-model estimate, where it gives one
    compile_seconds: float
    pallas_kernels: int  # Pallas (Mosaic) kernel calls in the compiled program: splash attention on TPU
    # The TPU compiler refuses a program whose temporaries exceed the chip's HBM: its message, and the
    # temporaries it asked for (then temp_bytes), with no FLOPs. "" when the step compiled.
    out_of_memory: str = ""

    @property
    def peak_bytes(self) -> int:
        """Arguments + temporaries + outputs not aliased to a donated argument: the step's resident peak."""
        return (
            self.argument_bytes
            + self.temp_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.generated_code_bytes
        )

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def tokens_per_device(self) -> float:
        return self.micro_batches * self.rows * self.seq_len / self.devices

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(peak_bytes=self.peak_bytes, tokens_per_device=self.tokens_per_device, devices=self.devices)
        return d


def compile_train_step(
    cfg,
    model_cfg: ModelConfig,
    devices: Sequence[Any],
    *,
    seq_len: int,
    micro_batch_size: int | None = None,
    micro_batches: int = 1,
    max_segments: int = 0,
    hbm_bytes: int = 0,
    mesh_sizes: dict[str, int] | None = None,
) -> tuple[Any, CompileReport]:
    """Compile the trainer step of `cfg` (the typed config) for `devices`; nothing is allocated.

    The mesh is `cfg.trainer.mesh` unless `mesh_sizes` ({"data", "fsdp", "context", "tensor"}) is given;
    a context size the model's heads or the row length cannot split raises ValueError (one line).

    `micro_batch_size` (default `trainer.micro_batch_size`) rows per data-parallel rank per micro-batch, as in
    the trainer; `hbm_bytes` (per device) sizes the LM head's saved-logits budget when the config leaves it
    on auto (the trainer asks the runtime, which a topology description does not have).
    """
    t = cfg.trainer
    engine = Engine.create(
        t,
        model_cfg,
        abstract=True,
        devices=devices,
        mesh_sizes=mesh_sizes,
        seed=cfg.run.seed,
        max_steps=cfg.run.max_steps,
        hbm_bytes=hbm_bytes,
    )
    mesh, state = engine.mesh, engine.state
    rows = (micro_batch_size or t.micro_batch_size) * dp_size(mesh)
    start = time.perf_counter()
    batch = engine.abstract_batch(micro_batches, rows, seq_len)
    remat = resolve_remat_policy(model_cfg.remat_policy, rows * seq_len)
    common = dict(
        mesh=dict(mesh.shape),
        remat_policy=remat,
        attention_impl=model_cfg.attention_impl,
        micro_batches=micro_batches,
        rows=rows,
        seq_len=seq_len,
    )
    lowered = engine.lower(batch, "rl", max_segments)
    with jax.set_mesh(mesh):
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            needed = _out_of_memory_bytes(str(e))
            if needed is None:
                raise
            args = sum(
                math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                for x in jax.tree.leaves((state, batch))
            )
            return None, CompileReport(
                **common,
                argument_bytes=args,
                output_bytes=0,
                alias_bytes=0,
                temp_bytes=needed,
                generated_code_bytes=0,
                flops=0.0,
                estimated_seconds=None,
                compile_seconds=time.perf_counter() - start,
                pallas_kernels=0,
                out_of_memory=str(e).splitlines()[0][:300],
            )
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    report = CompileReport(
        **common,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        generated_code_bytes=int(mem.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        estimated_seconds=cost.get("optimal_seconds"),
        compile_seconds=seconds,
        pallas_kernels=compiled.as_text().count('custom_call_target="tpu_custom_call"'),
    )
    return compiled, report


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _out_of_memory_bytes(message: str) -> int | None:
    """The temporaries a RESOURCE_EXHAUSTED compile error asked for, e.g. "... temporaries (140.78G) exceeds"."""
    m = re.search(r"Ran out of memory.*?temporaries \(([\d.]+)([KMGT]?)\)", message, re.S)
    return None if m is None else int(float(m[1]) * _UNITS[m[2]])


# Tried by `tools/tpu_compile.py --recommend`, mesh-major: FSDP alone with each policy in order of recompute
# (least first), then the context-parallel meshes, then the tensor-parallel ones (`recommend_meshes`); the first
# plan that fits is the pick. At a fixed number of tokens per chip, tensor parallelism does not shrink the
# activations remat trades against (a tensor group's rows are replicated on each of its chips) and adds
# communication, so it comes in only when no policy fits without; context parallelism is how a row longer than
# the tokens per chip is split at all, and it splits the activations with it (docs/tpu.md).
RECOMMEND_REMAT = ("dots_no_batch_attn", "attn", "full")


def resolve_mesh(mesh: dict[str, int], chips: int) -> dict[str, int]:
    """`trainer.mesh` sizes with its -1 axis filled in for `chips`; ValueError (one line naming the mesh)
    when they don't cover them."""
    from primejax.models.sharding import mesh_sizes

    try:
        return mesh_sizes(chips, **mesh)
    except ValueError as e:
        raise ValueError(f"trainer.mesh {mesh} does not cover the slice's {chips} chips: {e}") from None


def rows_per_rank(chips: int, mesh: dict[str, int], seq_len: int, tokens_per_chip: int) -> int | None:
    """Micro-batch rows per data-parallel rank giving `tokens_per_chip`; None if the mesh cannot.

    The data-parallel ranks are chips / (tensor x context): a tensor group shares its rows, and a context
    group splits each of its rows' tokens, so a row of T tokens over C chips is T / C tokens per chip.
    """
    dp = chips // (mesh["tensor"] * mesh.get("context", 1))
    rows, rem = divmod(tokens_per_chip * chips, seq_len)
    if rem or rows % dp or rows == 0:
        return None
    return rows // dp


def layout_error(model_cfg: ModelConfig, mesh: dict[str, int], seq_len: int) -> str:
    """Why the model cannot be laid out on `mesh` with rows of `seq_len` tokens ("" when it can)."""
    from primejax.models.context_parallel import check_divisible

    try:
        check_divisible(model_cfg.num_heads, mesh["tensor"], mesh.get("context", 1), seq_len)
    except ValueError as e:
        return str(e)
    return ""


def recommend_meshes(
    chips: int, model_cfg: ModelConfig, seq_len: int, tokens: int, tensors, contexts
) -> list[dict]:
    """The meshes --recommend tries, in order of `tensors`, each with the smallest of `contexts` that gives
    `tokens` per chip: FSDP alone (or a row over C chips), then tensor-parallel (docs/tpu.md). Each must
    divide the chips, its tensor size the kv heads, its tensor x context the query heads, its context the row.

    A larger context size than the smallest that works holds the same tokens per chip (its context group
    takes more rows), the same weight shards and the same attention heads per row-chip, so it is not tried.
    """
    meshes = []
    for tensor in tensors:
        if chips % tensor or model_cfg.num_kv_heads % tensor:
            continue
        for context in sorted(contexts):
            if chips % (tensor * context):
                continue
            mesh = {"data": 1, "fsdp": chips // (tensor * context), "context": context, "tensor": tensor}
            if layout_error(model_cfg, mesh, seq_len):
                continue
            if rows_per_rank(chips, mesh, seq_len, tokens) is not None:
                meshes.append(mesh)
                break
    return meshes
