"""The trainer engine: the one object that owns everything a compiled training step needs.

Built once from the typed config (`TrainerConfig` + the model's shape), an `Engine` holds

- the device mesh (`trainer.mesh`, or explicit sizes and devices for ahead-of-time compiles),
- the model graph and the `TrainState` (fp32 master parameters, optimizer state, step, RNG), either concrete
  (loaded or randomly initialized, sharded by the model's rules) or abstract (`jax.ShapeDtypeStruct`s carrying
  their `NamedSharding`s: nothing is allocated, the step compiles for devices this process need not have),
- the optimizer and schedule, with the optimizer state sharded like the parameters,
- the compiled functions: the RL step (`trainer.loss`), the SFT step (the fixed ce/rl defaults, so a custom
  rl loss never reaches SFT), a forward-only logprob pass and the finite-parameters check.

The RL trainer (trainer/loop.py), SFT (entrypoints/sft.py), the TPU compile tool (trainer/aot.py) and every trainer
benchmark in tools/ construct it, so a benchmark times exactly the function the trainer runs; nothing else
compiles a training step. The step's math lives in trainer/step.py (unjitted); how it is sharded, compiled and
fed lives here. docs/engine.md shows what a new mesh axis or step argument touches.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from primejax.contracts.batch import FIELDS, PackedBatch
from primejax.models import lora, lora_io
from primejax.models.attention import resolve_impl
from primejax.models.config import ModelConfig
from primejax.models.context_parallel import check_divisible
from primejax.models.settings import ModelSettings
from primejax.models.sharding import axis_size, make_mesh, state_shardings
from primejax.models.transformer import Transformer, init_model
from primejax.trainer import optim
from primejax.trainer.config import LossConfig, TrainerConfig
from primejax.trainer.corrections import CorrectionTable
from primejax.trainer.logprobs import AUTO_SAVED_LOGITS_FRACTION, saved_logits_max_bytes
from primejax.trainer.offload import Offload, make_offload
from primejax.trainer.step import (
    TrainState,
    batch_sharding,
    device_batch,
    dp_size,
    init_state,
    leaf_sharding,
    make_train_step,
    max_segments_bucket,
    opt_state_shardings,
    shard_state,
    target_logprobs,
    to_micro_batches,
    tree_all_finite,
)

log = logging.getLogger("primejax.trainer")

# The compiled steps: "rl" trains with `trainer.loss`; "sft" with the default loss section (its ce component
# is what SFT batches weight), whatever the rl loss is configured to.
STEP_KINDS = ("rl", "sft")


def model_config(m: ModelSettings, *, max_positions: int = 4096) -> ModelConfig:
    """The model's shape and training choices, as `build_model` makes them, without touching any weights."""
    if not m.path:
        return m.build_tiny.architecture(max_positions=max(4096, max_positions), **m.overrides())
    if not (Path(m.path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path {m.path!r} has no config.json")
    return ModelConfig.from_model_dir(m.path, **m.overrides())


def build_model(
    m: ModelSettings, mesh: Mesh, *, seed: int = 0, max_positions: int = 4096
) -> tuple[nnx.Module, ModelConfig]:
    """Load `model.path` (HF safetensors); a directory with only config.json gets random weights (benchmarks)."""
    from primejax.models.hf_io import load_model

    if m.path and any(Path(m.path).glob("*.safetensors")):
        model, cfg = load_model(Path(m.path), mesh=mesh, **m.overrides())
        return lora.fill_adapters(model, seed, mesh), cfg  # HF weights hold no adapters: fresh ones
    model_cfg = model_config(m, max_positions=max_positions)
    if m.path:
        log.info("no safetensors in %s: random init (benchmark use)", m.path)
    return init_model(model_cfg, mesh, seed), model_cfg


def jit_train_step(step_fn: Callable, state: TrainState, mesh: Mesh, frozen: Any = None) -> Callable:
    """jit with the state's shardings pinned on input and output (so a step's output feeds the next one without
    a second compilation), the batch's rows over the data-parallel axes, and the state donated. With LoRA the
    step takes the frozen weights as a third argument, in their own shardings and never donated."""
    state_sh = jax.tree.map(lambda x: leaf_sharding(x, mesh), state)
    in_sh = (state_sh, batch_sharding(mesh))
    if frozen is not None:
        in_sh += (jax.tree.map(lambda x: leaf_sharding(x, mesh), frozen),)
    return jax.jit(
        step_fn,
        in_shardings=in_sh,
        out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0,),
    )


def _sds(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def abstract_state(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    seed: int = 0,
    offload: Callable[[Any], Offload] | None = None,
) -> tuple[nnx.GraphDef, TrainState, dict | None, Offload | None]:
    """(graphdef, TrainState of ShapeDtypeStructs, frozen weights or None, offload or None) in the layout
    `step.init_state` gives the real state (with LoRA the state holds the adapters and the frozen weights come
    apart). `offload`: builds the host-offloaded update for the trained parameters (opt_state in host memory)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(seed))))
    shardings = nnx.to_pure_dict(state_shardings(state, mesh))
    params = jax.tree.map(_sds, nnx.to_pure_dict(state), shardings)
    frozen = None
    if model_cfg.lora_rank:
        params, frozen = lora.split_adapters(params)
    off = offload(params) if offload is not None else None
    if off is not None:
        opt_state = off.abstract()
    else:
        opt_state = jax.tree.map(
            _sds, jax.eval_shape(optimizer.init, params), opt_state_shardings(optimizer, params, mesh)
        )
    replicated = NamedSharding(mesh, PartitionSpec())
    rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(seed)))
    return (
        graphdef,
        TrainState(
            params, opt_state, _sds(jax.ShapeDtypeStruct((), jnp.int32), replicated), _sds(rng, replicated)
        ),
        frozen,
        off,
    )


@dataclasses.dataclass
class Engine:
    """Mesh, model graph, state, optimizer and compiled steps of one trainer (see the module docstring).

    Construct with `Engine.create` (a model config: random or abstract weights, or a given model) or
    `Engine.from_settings` (the `model` config section: HF weights loaded onto the mesh).
    """

    t: TrainerConfig
    model_cfg: ModelConfig
    mesh: Mesh
    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    state: TrainState  # concrete arrays, or ShapeDtypeStructs when `abstract`
    abstract: bool
    saved_logits_bytes: int  # the LM head's budget for the whole (global) micro-batch
    # the rl loss's off-policy corrections per environment (trainer/corrections.py); SFT steps take none
    corrections: CorrectionTable = dataclasses.field(default_factory=CorrectionTable)
    # LoRA (`model.lora`, models/lora.py): the state's params are the adapters and these the frozen weights
    # (in `model.param_dtype`), a constant input of every step; None without LoRA.
    frozen: dict | None = None
    # `trainer.optim.offload` (trainer/offload.py): the state's opt_state (fp32 master + AdamW) in host memory
    offload: Offload | None = None
    _compiled: dict[tuple[str, int], Callable] = dataclasses.field(default_factory=dict, repr=False)
    _finite: Callable | None = dataclasses.field(default=None, repr=False)
    _logprobs: Callable | None = dataclasses.field(default=None, repr=False)

    # ------------------------------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls,
        t: TrainerConfig,
        model_cfg: ModelConfig,
        *,
        model: nnx.Module | None = None,
        mesh: Mesh | None = None,
        seed: int = 0,
        max_steps: int = 1,
        lr_schedule: optax.Schedule | None = None,
        abstract: bool = False,
        devices: Sequence[Any] | None = None,
        mesh_sizes: Mapping[str, int] | None = None,
        hbm_bytes: int = 0,
        corrections: CorrectionTable | None = None,
    ) -> Engine:
        """An engine for `model_cfg` under the trainer section `t`.

        `model`: its parameters become the state (default: a random init on the mesh; `abstract`: none at all).
        `mesh`: default `trainer.mesh` (or `mesh_sizes`) over `devices` (default: all).
        `lr_schedule`: replaces `trainer.scheduler` (SFT's constant `sft.lr`); the optimizer is `trainer.optim`.
        `hbm_bytes` (abstract engines): per-device memory for the LM head's auto budget, which the runtime cannot
        report for a topology's devices (0: the head keeps no logits). Concrete engines ask the device.
        """
        if mesh is None:
            mesh = make_mesh(**dict(mesh_sizes or t.mesh.to_dict()), devices=devices)
        if lr_schedule is None:
            optimizer, schedule = optim.from_config(t.optim, t.scheduler, max_steps)
        else:
            optimizer, schedule = optim.make_optimizer(t.optim, lr_schedule), lr_schedule
        frozen, off = None, None
        offload = _offload_builder(t, schedule, mesh)
        if abstract:
            graphdef, state, frozen, off = abstract_state(model_cfg, optimizer, mesh, seed, offload)
        else:
            if model is None:
                model = init_model(model_cfg, mesh, seed)
            graphdef = nnx.graphdef(model)
            trained = nnx.to_pure_dict(nnx.state(model))
            if model_cfg.lora_rank:
                trained, frozen = lora.split_adapters(trained)
            if offload is not None:
                off = offload(trained)
                state = TrainState(
                    trained,
                    off.init(trained),
                    jnp.zeros((), jnp.int32),
                    jax.random.key_data(jax.random.key(seed)),
                )
                state = shard_state(state, mesh)
            else:
                state = init_state(trained, optimizer, seed, mesh=mesh)
        return cls(
            t,
            model_cfg,
            mesh,
            graphdef,
            optimizer,
            schedule,
            state,
            abstract,
            _head_budget(t, mesh, hbm_bytes if abstract else None),
            corrections or CorrectionTable(),
            frozen,
            off,
        )

    @classmethod
    def from_settings(
        cls,
        t: TrainerConfig,
        settings: ModelSettings,
        *,
        seed: int = 0,
        max_steps: int = 1,
        max_positions: int = 4096,
        lr_schedule: optax.Schedule | None = None,
        corrections: CorrectionTable | None = None,
    ) -> Engine:
        """The trainer's engine: `model.path` loaded (or initialized, see `build_model`) onto `trainer.mesh`."""
        mesh = make_mesh(**t.mesh.to_dict())
        model, model_cfg = build_model(settings, mesh, seed=seed, max_positions=max_positions)
        return cls.create(
            t,
            model_cfg,
            model=model,
            mesh=mesh,
            seed=seed,
            max_steps=max_steps,
            lr_schedule=lr_schedule,
            corrections=corrections,
        )

    # ------------------------------------------------------------------------------------------ compiled steps

    def loss_config(self, kind: str) -> LossConfig:
        if kind not in STEP_KINDS:
            raise ValueError(f"step kind {kind!r} is not one of {STEP_KINDS}")
        return self.t.loss if kind == "rl" else LossConfig()

    def segments_key(self, kind: str, max_segments: int) -> int:
        """The static bound on samples per row the step is compiled for.

        A per-sequence rl objective (trainer/objectives.py) loops over a row's samples and cuDNN attention sizes its per-row work by the bound (a
        loose bound costs step time), so there it is kept, rounded up to a power of two to limit recompiles.
        Elsewhere the bound changes nothing, so one compiled step (key 0) serves every batch.
        """
        m = self.model_cfg
        uses_segments = resolve_impl(m.attention_impl, jnp.dtype(m.compute_dtype)) == "cudnn"
        if max_segments <= 0 or (self.loss_config(kind).type == "default" and not uses_segments):
            return 0  # 0 = unknown: the objective and the kernel then assume their largest bound
        return 1 << (max_segments - 1).bit_length()

    def step_fn(self, kind: str = "rl", max_segments: int = 0) -> Callable:
        """The jitted step train_step(state, batch[M, R, T]) -> (state, metrics) the trainer runs (cached)."""
        key = (kind, self.segments_key(kind, max_segments))
        if key not in self._compiled:
            fn = make_train_step(
                self.graphdef,
                self.optimizer,
                self.schedule,
                self.loss_config(kind),
                chunk_size=self.t.logprob_chunk_size,
                max_segments=key[1],
                saved_logits_max_bytes=self.saved_logits_bytes,
                corrections=self.corrections if kind == "rl" else None,
                offload=self.offload,
            )
            self._compiled[key] = jit_train_step(fn, self.state, self.mesh, self.frozen)
        return self._compiled[key]

    def lower(self, batch: Mapping[str, Any], kind: str = "rl", max_segments: int = 0) -> jax.stages.Lowered:
        """The step lowered for `batch` (arrays or ShapeDtypeStructs): `.compile()` gives the executable and its
        memory and cost analyses (AOT, benchmarks); calling it runs exactly what `step_fn` runs."""
        with jax.set_mesh(self.mesh):
            return self.step_fn(kind, max_segments).lower(self.state, batch, *self._frozen_arg())

    def abstract_batch(self, micro_batches: int, rows: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The step's [M, R, T] batch arrays (contracts.batch.FIELDS) as ShapeDtypeStructs with their sharding."""
        check_divisible(
            self.model_cfg.num_heads, axis_size(self.mesh, "q_heads"), axis_size(self.mesh, "seq"), seq_len
        )
        sh = batch_sharding(self.mesh)
        return {
            k: jax.ShapeDtypeStruct((micro_batches, rows, seq_len), dt, sharding=sh)
            for k, dt in FIELDS.items()
        }

    # ------------------------------------------------------------------------------------------ running

    @property
    def micro_rows(self) -> int:
        """Rows of this process's batch file in one micro-batch (`micro_batch_size` per data-parallel rank)."""
        return self.t.micro_batch_size * dp_size(self.mesh) // jax.process_count()

    def place(self, batch: PackedBatch) -> dict[str, jax.Array]:
        """This process's rows as the global [M, R, T] device batch, split into micro-batches of `micro_rows`."""
        return self.device_batch(to_micro_batches(batch, self.micro_rows))

    def device_batch(self, arrays: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's [M, R, T] host arrays (already split into micro-batches) as the global device batch."""
        return device_batch(arrays, self.mesh)

    def run(self, arrays: Mapping[str, jax.Array], kind: str = "rl", max_segments: int = 0) -> dict[str, Any]:
        """One step on placed arrays: the state advances; the metrics come back as device arrays (no sync)."""
        with jax.set_mesh(self.mesh):
            self.state, metrics = self.step_fn(kind, max_segments)(self.state, arrays, *self._frozen_arg())
        return metrics

    def train(self, batch: PackedBatch, kind: str = "rl") -> tuple[dict[str, np.ndarray], int]:
        """One step on this process's packed rows: (host metrics, tokens of the whole step's micro-batches over
        every process, padding included: prime-rl's throughput count)."""
        max_segments = int(batch.meta.get("max_segments") or max_segments_bucket(batch))
        arrays = self.place(batch)
        metrics = jax.device_get(self.run(arrays, kind, max_segments))
        return metrics, arrays["tokens"].size

    def params_finite(self) -> bool:
        """Whether every parameter is finite (one compiled reduction, one host sync)."""
        if self._finite is None:
            self._finite = jax.jit(tree_all_finite)
        with jax.set_mesh(self.mesh):
            return bool(self._finite(self.state.params))

    def logprobs(self, arrays: Mapping[str, Any], chunk_size: int | None = None) -> jax.Array:
        """Forward only: [B, T] logprob of each token given its prefix (`step.target_logprobs`) under the state's
        parameters; `arrays` are [B, T] batch streams."""
        if self._logprobs is None:
            chunk = chunk_size or self.t.logprob_chunk_size
            graphdef = self.graphdef
            self._logprobs = jax.jit(lambda p, a: target_logprobs(nnx.merge(graphdef, p), a, chunk))
        with jax.set_mesh(self.mesh):
            return self._logprobs(self.params(), dict(arrays))

    def _frozen_arg(self) -> tuple:
        return () if self.frozen is None else (self.frozen,)

    def params(self) -> dict:
        """Every parameter of the model (with LoRA: the adapters joined with the frozen weights)."""
        return self.state.params if self.frozen is None else lora.join_params(self.state.params, self.frozen)

    def model(self) -> nnx.Module:
        """The model with the state's current parameters (for export and evaluation). With LoRA, the merged
        model (every adapted weight W + s·A·B, no adapters): what an HF export or a full-weight sync carries;
        `lora_model()` is the model with its adapters apart."""
        if self.frozen is None:
            return nnx.merge(self.graphdef, self.state.params)
        with jax.set_mesh(self.mesh):
            return lora_io.merged_model(self.params(), self.model_cfg)

    def lora_model(self) -> nnx.Module:
        """The model with its adapters as separate parameters (LoRA engines; PEFT export reads them)."""
        return nnx.merge(self.graphdef, self.params())


def _offload_builder(
    t: TrainerConfig, schedule: optax.Schedule, mesh: Mesh
) -> Callable[[Any], Offload] | None:
    """`trainer.optim.offload`: a function from the trained parameters (arrays or ShapeDtypeStructs) to their
    offloaded update, or None when the optimizer state stays on the devices."""
    if not getattr(t.optim, "offload", False):
        return None
    clip, adamw = optim.optimizer_parts(t.optim, schedule)
    o = t.optim
    return lambda params: make_offload(
        params,
        clip,
        adamw,
        mesh,
        o.offload_bucket_mb,
        master_on_host=o.offload_master,
        inflight=o.offload_inflight,
        resident_gib=o.offload_resident_gib,
    )


def _head_budget(t: TrainerConfig, mesh: Mesh, hbm_bytes: int | None) -> int:
    """The step's `saved_logits_max_bytes` for the whole micro-batch from the per-device setting.

    The head sees the global micro-batch, whose rows are split over the data-parallel axes (and their tokens
    over `context`), so the per-device budget scales with their sizes. `hbm_bytes` (abstract engines) stands
    in for the runtime's allocator limit, which a topology description does not have.
    """
    gib = t.lm_head_saved_logits_gib
    if gib < 0 and hbm_bytes is not None:
        per_device = int(AUTO_SAVED_LOGITS_FRACTION * hbm_bytes)
    else:
        per_device = saved_logits_max_bytes(gib)
    return per_device * axis_size(mesh, "batch_context")


__all__ = ["Engine", "STEP_KINDS", "abstract_state", "build_model", "jit_train_step", "model_config"]
