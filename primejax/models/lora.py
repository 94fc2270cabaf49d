"""LoRA: low-rank adapters next to frozen weights (the `model.lora` section, docs/lora.md).

An adapted weight W keeps its value and gains two trainable parameters, A (input side, rank r out) and B (rank r
in, output side); the layer computes x·W + s·(x·A)·B with s = alpha / r (PEFT's `scaling`), never W + s·A·B, so
neither the forward nor the backward pass materializes a full-size weight or gradient. A starts
kaiming-uniform as PEFT's (`kaiming_uniform_(a=sqrt(5))`: U(-1/sqrt(fan_in), 1/sqrt(fan_in))) and B at zero,
so a fresh adapter leaves the model unchanged.

Adapters are `LoraParam`s in the decoder stack, stacked over layers like the weight they adapt and named after
it: `q_proj_lora_a` [L, D, r] / `q_proj_lora_b` [L, r, H, Dh]. In general A takes the weight's input axes and
B its output axes (their logical axes too, so they shard like it); `o_proj`'s input is (H, Dh). MoE experts
get one adapter per expert: `experts_gate_up_lora_a` [Ls, E, D, 2, r] / `_lora_b` [Ls, E, 2, r, I] (separate
gate and up adapters, as PEFT's per-expert `gate_proj` / `up_proj`), `experts_down_lora_a` [Ls, E, I, r] /
`_lora_b` [Ls, E, r, D]. The router's adapter ([D, r] / [r, E]) is merged into the tiny router matrix.

The trainer differentiates only the adapters: `split_adapters` cuts the parameter dict into the adapters (the
TrainState's params: fp32, with their AdamW state) and the frozen rest (kept in `model.param_dtype`, passed to
the step as a constant); `join_params` puts them back together for the forward pass.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from primejax.models.config import ModelConfig
from primejax.models.lora_config import DEFAULT_TARGETS, LoraConfig

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
# Adapted dense weights -> how many of their leading (after `layers`) axes are input axes.
DENSE_INPUT_AXES = {
    "q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1, "router": 1,
}  # fmt: skip
EXPERT_WEIGHTS = ("experts_gate_up", "experts_down")  # the target "experts"


class LoraParam(nnx.Param):
    """An adapter matrix: trained, while the `nnx.Param`s it sits next to stay frozen under LoRA."""


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """One adapter pair of a stacked weight: shapes and logical axes of A and B, and A's fan-in."""

    a_shape: tuple[int, ...]
    a_axes: tuple[str | None, ...]
    b_shape: tuple[int, ...]
    b_axes: tuple[str | None, ...]
    fan_in: int


def adapted_weights(
    cfg: ModelConfig, base: dict[str, tuple[tuple[int, ...], tuple]]
) -> dict[str, AdapterSpec]:
    """The adapters `cfg` asks for, by the name of the weight they adapt; `base` maps the decoder stack's
    weights present in this model to (shape, logical axes)."""
    if not cfg.lora_rank:
        return {}
    r = cfg.lora_rank
    out: dict[str, AdapterSpec] = {}
    for name in cfg.lora_targets:
        if name == "experts":
            if "experts_gate_up" in base:
                (ls, e, d, two, i), ax = base["experts_gate_up"]
                out["experts_gate_up"] = AdapterSpec(
                    (ls, e, d, two, r), (*ax[:4], None), (ls, e, two, r, i), (*ax[:2], None, None, ax[4]), d
                )
                (ls, e, i, d), ax = base["experts_down"]
                out["experts_down"] = AdapterSpec(
                    (ls, e, i, r), (*ax[:3], None), (ls, e, r, d), (*ax[:2], None, ax[3]), i
                )
        elif name in base:
            shape, ax = base[name]
            n = DENSE_INPUT_AXES[name] + 1  # the layer axis, then the input axes
            out[name] = AdapterSpec(
                (*shape[:n], r), (*ax[:n], None), (shape[0], r, *shape[n:]), (ax[0], None, *ax[n:]),
                math.prod(shape[1:n]),
            )  # fmt: skip
    return out


def init_a(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """PEFT's kaiming_uniform_(a=sqrt(5)) of lora_A: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), in fp32."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def adapter_params(
    specs: dict[str, AdapterSpec], key: jax.Array, init: str = "kaiming"
) -> dict[str, LoraParam]:
    """Fresh adapters (fp32 whatever the model's param dtype): A random (`LORA_INITS`), B zeros."""
    out = {}
    for i, (name, s) in enumerate(sorted(specs.items())):
        k = jax.random.fold_in(key, i)
        if init == "gaussian":  # PEFT's init_lora_weights="gaussian": A ~ N(0, 1/r)
            a = jax.random.normal(k, s.a_shape, jnp.float32) / s.a_shape[-1]
        else:
            a = init_a(k, s.a_shape, s.fan_in)
        out[name + SUFFIX_A] = LoraParam(a, logical_axes=s.a_axes)
        out[name + SUFFIX_B] = LoraParam(jnp.zeros(s.b_shape, jnp.float32), logical_axes=s.b_axes)
    return out


def is_adapter(name: str) -> bool:
    return name.endswith((SUFFIX_A, SUFFIX_B))


def base_name(name: str) -> str:
    """The weight a (stacked) parameter name belongs to: `q_proj_lora_a` -> `q_proj`; others unchanged."""
    return name[: -len(SUFFIX_A)] if is_adapter(name) else name


# ------------------------------------------------------------------------------------------ forward


def dense_delta(x: jax.Array, p: dict[str, jax.Array], name: str, scale: float) -> jax.Array | None:
    """s·(x·A)·B of adapted weight `name` for one layer's parameters `p` (None when it has no adapter).

    x [..., *in] in the compute dtype -> [..., *out]; the adapters are cast to it like the weights."""
    a = p.get(name + SUFFIX_A)
    if a is None:
        return None
    n_in = DENSE_INPUT_AXES[name]
    xa = jnp.tensordot(x, a.astype(x.dtype), axes=n_in) * jnp.asarray(scale, x.dtype)
    return jnp.tensordot(xa, p[name + SUFFIX_B].astype(x.dtype), axes=1)


def with_adapter(y: jax.Array, x: jax.Array, p: dict[str, jax.Array], name: str, scale: float) -> jax.Array:
    """y = x·W plus the adapter's s·(x·A)·B when `name` has one."""
    d = dense_delta(x, p, name, scale)
    return y if d is None else y + d


def expert_adapters(p: dict[str, jax.Array], dtype) -> tuple[jax.Array, ...] | None:
    """One sparse layer's per-expert adapters (gate_up A, B, down A, B) in `dtype`, or None."""
    names = [w + s for w in EXPERT_WEIGHTS for s in (SUFFIX_A, SUFFIX_B)]
    if names[0] not in p:
        return None
    return tuple(p[n].astype(dtype) for n in names)


def router_weight(p: dict[str, jax.Array], scale: float) -> jax.Array:
    """The router [D, E] with its adapter merged in fp32 (a D x E matrix: merging costs nothing)."""
    w = p["router"]
    if "router" + SUFFIX_A not in p:
        return w
    a, b = p["router" + SUFFIX_A], p["router" + SUFFIX_B]
    return w.astype(jnp.float32) + scale * (a.astype(jnp.float32) @ b.astype(jnp.float32))


# ------------------------------------------------------------------------------------------ parameter trees


def _is_adapter_path(path) -> bool:
    key = getattr(path[-1], "key", None)
    return isinstance(key, str) and is_adapter(key)


def split_adapters(params: dict) -> tuple[dict, dict]:
    """(adapters, frozen) of a nested parameter dict (`nnx.to_pure_dict` form; leaves may be abstract)."""

    def go(tree: dict, path: tuple) -> tuple[dict, dict]:
        lora, rest = {}, {}
        for k, v in tree.items():
            if isinstance(v, dict):
                a, b = go(v, (*path, k))
                if a:
                    lora[k] = a
                if b:
                    rest[k] = b
            elif isinstance(k, str) and is_adapter(k):
                lora[k] = v
            else:
                rest[k] = v
        return lora, rest

    return go(params, ())


def join_params(adapters: dict, frozen: dict) -> dict:
    """The whole parameter dict from `split_adapters`' two parts."""
    out = dict(frozen)
    for k, v in adapters.items():
        out[k] = join_params(v, out.get(k, {})) if isinstance(v, dict) else v
    return out


def weight_delta(name: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """A·B of stacked adapters in the stacked weight's layout (fp32), without the scale."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if name == "experts_gate_up":
        return jnp.einsum("ledcr,lecri->ledci", a, b)
    if name == "experts_down":
        return jnp.einsum("leir,lerd->leid", a, b)
    return jax.vmap(lambda x, y: jnp.tensordot(x, y, axes=1))(a, b)


def merge_adapters(params: dict, cfg: ModelConfig) -> dict:
    """The parameters of the same model without adapters: every adapted weight W becomes W + s·A·B (computed
    in fp32, stored in W's dtype). `params` holds both (`join_params`)."""
    layers = params["layers"]
    merged = {k: v for k, v in layers.items() if not is_adapter(k)}
    for k in layers:
        if k.endswith(SUFFIX_A):
            w = base_name(k)
            delta = cfg.lora_scale * weight_delta(w, layers[k], layers[w + SUFFIX_B])
            merged[w] = (layers[w].astype(jnp.float32) + delta).astype(layers[w].dtype)
    return {**params, "layers": merged}


def without_lora(cfg: ModelConfig) -> ModelConfig:
    """The same architecture with no adapters (the merged model's config)."""
    return dataclasses.replace(cfg, lora_rank=0, lora_alpha=0.0, lora_targets=(), lora_init="kaiming")


def stack_adapters(layers: nnx.Module, cfg: ModelConfig) -> dict[str, AdapterSpec]:
    """The adapters `cfg` asks for on the decoder stack `layers` (from its frozen weights' shapes and axes)."""
    base = {
        k: (tuple(v.shape), tuple(v.get_metadata()["logical_axes"]))
        for k, v in vars(layers).items()
        if isinstance(v, nnx.Param) and not isinstance(v, LoraParam)
    }
    specs = adapted_weights(cfg, base)
    if cfg.lora_rank and not specs:
        raise ValueError(
            f"model.lora.target_modules {list(cfg.lora_targets)} match no weight of this {cfg.model_type} model"
        )
    return specs


def fill_adapters(model: nnx.Module, seed: int = 0, mesh: Any = None) -> nnx.Module:
    """Give the adapters of `model` fresh values (after loading HF weights, which hold none, they are still
    abstract), created under jit directly in their sharded layout. Returns the same model."""
    from primejax.models.sharding import logical_to_spec

    specs = stack_adapters(model.layers, model.cfg)
    if not specs:
        return model
    init = model.cfg.lora_init

    def make():
        return {k: v[...] for k, v in adapter_params(specs, jax.random.key(seed), init).items()}

    if mesh is None:
        values = jax.jit(make)()
    else:
        from jax.sharding import NamedSharding

        sh = {}
        for name, s in specs.items():
            sh[name + SUFFIX_A] = NamedSharding(mesh, logical_to_spec(s.a_axes, s.a_shape, mesh))
            sh[name + SUFFIX_B] = NamedSharding(mesh, logical_to_spec(s.b_axes, s.b_shape, mesh))
        with jax.set_mesh(mesh):
            values = jax.jit(make, out_shardings=sh)()
    for k, v in values.items():
        getattr(model.layers, k).set_value(v)
    return model


__all__ = [
    "DEFAULT_TARGETS",
    "LoraConfig",
    "LoraParam",
    "adapted_weights",
    "adapter_params",
    "base_name",
    "fill_adapters",
    "is_adapter",
    "join_params",
    "merge_adapters",
    "split_adapters",
    "stack_adapters",
    "weight_delta",
    "without_lora",
]
