"""Hugging Face safetensors <-> primejax parameters.

Names and shapes on disk are exactly HF's (`model.layers.{i}.self_attn.q_proj.weight`, Linear weights as
[out, in]); inside primejax, layer weights are stacked over layers and laid out for einsum (transformer.py).
The conversion is one table, `_LAYER_TENSORS`, used in both directions; MoE experts (`_EXPERT_TENSORS`)
map one stacked parameter to one HF tensor per expert.

MoE layout on disk: one tensor per expert (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [I, D], `up_proj`,
`down_proj` [D, I]) and the router `mlp.gate.weight` [E, D]. That is the Hub's Qwen3-MoE layout, what
transformers 5.17's `save_pretrained` writes by default and what every vLLM version loads (vLLM 0.31 also
reads transformers' fused `mlp.experts.gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I], older readers do
not). Loading accepts both.

Memory: loading reads one parameter kind at a time (e.g. `q_proj` of all layers) into host memory and places
it straight into its sharded device array, so the host never holds more than one stacked parameter and the
model is never materialized whole on one device. Export streams tensors the same way and writes one
safetensors shard at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from primejax.models.config import ModelConfig
from primejax.models.lora import LoraParam
from primejax.models.sharding import param_spec
from primejax.models.transformer import Transformer, stacked_over

# Files copied next to exported weights so the directory is a complete model for transformers / vLLM.
AUX_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

Converter = Callable[[np.ndarray, ModelConfig], np.ndarray]


def _to_out_in(w_in_out: np.ndarray, cfg: ModelConfig) -> np.ndarray:  # [D, ...] -> HF [prod(...), D]
    return w_in_out.reshape(w_in_out.shape[0], -1).T


def _heads_to_out_in(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:  # o_proj [H, Dh, D] -> HF [D, H*Dh]
    return w.reshape(-1, w.shape[-1]).T


def _flat(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.reshape(-1)


def _same(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w


def _transpose(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.T


# ours (in DecoderStack) -> (HF suffix under model.layers.{i}., to_hf, from_hf)
_LAYER_TENSORS: dict[str, tuple[str, Converter, Converter]] = {
    "attn_norm": ("input_layernorm.weight", _same, _same),
    # Qwen3.5 (attn_output_gate): each head's rows are [query | output gate], kept together per head
    "q_proj": (
        "self_attn.q_proj.weight",
        _to_out_in,
        lambda w, c: w.T.reshape(c.hidden_size, c.num_heads, -1),
    ),
    "k_proj": (
        "self_attn.k_proj.weight",
        _to_out_in,
        lambda w, c: w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
    ),
    "v_proj": (
        "self_attn.v_proj.weight",
        _to_out_in,
        lambda w, c: w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
    ),
    "o_proj": (
        "self_attn.o_proj.weight",
        _heads_to_out_in,
        lambda w, c: w.T.reshape(c.num_heads, c.v_dim, c.hidden_size),
    ),
    "q_bias": ("self_attn.q_proj.bias", _flat, lambda w, c: w.reshape(c.num_heads, c.head_dim)),
    "k_bias": ("self_attn.k_proj.bias", _flat, lambda w, c: w.reshape(c.num_kv_heads, c.head_dim)),
    "v_bias": ("self_attn.v_proj.bias", _flat, lambda w, c: w.reshape(c.num_kv_heads, c.head_dim)),
    "o_bias": ("self_attn.o_proj.bias", _same, _same),
    "q_norm": ("self_attn.q_norm.weight", _same, _same),
    "k_norm": ("self_attn.k_norm.weight", _same, _same),
    # multi-head latent attention (models/mla.py; q_proj and o_proj above)
    "q_a_proj": ("self_attn.q_a_proj.weight", _transpose, _transpose),
    "q_a_norm": ("self_attn.q_a_layernorm.weight", _same, _same),
    "q_b_proj": (
        "self_attn.q_b_proj.weight",
        _to_out_in,
        lambda w, c: w.T.reshape(c.q_lora_rank, c.num_heads, c.qk_head_dim),
    ),
    "kv_a_proj": ("self_attn.kv_a_proj_with_mqa.weight", _transpose, _transpose),
    "kv_a_norm": ("self_attn.kv_a_layernorm.weight", _same, _same),
    "kv_b_proj": (
        "self_attn.kv_b_proj.weight",
        _to_out_in,
        lambda w, c: w.T.reshape(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim),
    ),
    # Gated DeltaNet (models/deltanet.py); conv1d.weight is [C, 1, Kc]
    "lin_qkv": ("linear_attn.in_proj_qkv.weight", _transpose, _transpose),
    "lin_conv": ("linear_attn.conv1d.weight", lambda w, c: w.T[:, None, :], lambda w, c: w[:, 0, :].T),
    "lin_z": (
        "linear_attn.in_proj_z.weight",
        _to_out_in,
        lambda w, c: w.T.reshape(c.hidden_size, c.linear_num_value_heads, c.linear_value_head_dim),
    ),
    "lin_a": ("linear_attn.in_proj_a.weight", _transpose, _transpose),
    "lin_b": ("linear_attn.in_proj_b.weight", _transpose, _transpose),
    "lin_A_log": ("linear_attn.A_log", _same, _same),
    "lin_dt_bias": ("linear_attn.dt_bias", _same, _same),
    "lin_norm": ("linear_attn.norm.weight", _same, _same),
    "lin_out": (
        "linear_attn.out_proj.weight",
        _heads_to_out_in,
        lambda w, c: w.T.reshape(c.linear_num_value_heads, c.linear_value_head_dim, c.hidden_size),
    ),
    "mlp_norm": ("post_attention_layernorm.weight", _same, _same),
    "gate_proj": ("mlp.gate_proj.weight", _transpose, _transpose),
    "up_proj": ("mlp.up_proj.weight", _transpose, _transpose),
    "down_proj": ("mlp.down_proj.weight", _transpose, _transpose),
    "router": ("mlp.gate.weight", _transpose, _transpose),
    # the sigmoid router's correction bias and the shared experts
    "router_bias": ("mlp.gate.e_score_correction_bias", _same, _same),
    "shared_gate_proj": ("mlp.shared_experts.gate_proj.weight", _transpose, _transpose),
    "shared_up_proj": ("mlp.shared_experts.up_proj.weight", _transpose, _transpose),
    "shared_down_proj": ("mlp.shared_experts.down_proj.weight", _transpose, _transpose),
    # the shared expert's gate, HF Linear(D, 1) [1, D]. A family whose names differ says so in its
    # `tensor_names` (models/families/base.py)
    "shared_expert_gate": ("mlp.shared_expert_gate.weight", lambda w, c: w[None, :], lambda w, c: w[0]),
}
# Written in fp32 whatever the export dtype, as transformers (`_keep_in_fp32_modules_strict`) and vLLM keep
# them: the correction bias decides between experts whose scores differ by less than bf16 resolves.
FP32_TENSORS = ("router_bias",)
# ours [E, D, 2, I] / [E, I, D] per sparse layer -> per expert: [(HF suffix with {e}, ours -> HF [out, in])]
_EXPERT_TENSORS: dict[str, list[tuple[str, Callable[[np.ndarray, int], np.ndarray]]]] = {
    "experts_gate_up": [
        ("mlp.experts.{e}.gate_proj.weight", lambda w, e: w[e, :, 0, :].T),
        ("mlp.experts.{e}.up_proj.weight", lambda w, e: w[e, :, 1, :].T),
    ],
    "experts_down": [("mlp.experts.{e}.down_proj.weight", lambda w, e: w[e].T)],
}
# transformers' fused in-memory form (save_original_format=False): gate_up [E, 2I, D] gate rows first, down [E, D, I]
_FUSED_EXPERTS = {
    "experts_gate_up": (
        "mlp.experts.gate_up_proj",
        lambda w, c: w.reshape(w.shape[0], 2, -1, w.shape[-1]).transpose(0, 3, 1, 2),
    ),
    "experts_down": ("mlp.experts.down_proj", lambda w, c: w.transpose(0, 2, 1)),
}
_TOP_TENSORS: dict[str, tuple[str, Converter, Converter]] = {
    "embed": ("model.embed_tokens.weight", _same, _same),
    "final_norm": ("model.norm.weight", _same, _same),
    "lm_head": ("lm_head.weight", _transpose, _transpose),
}


def param_variables(model: Transformer) -> dict[str, nnx.Variable]:
    """Our parameters by dotted name ("embed", "layers.q_proj", ...), in a fixed order. LoRA adapters are not
    HF model tensors (models/lora_io.py writes them the PEFT way)."""
    out = {name: getattr(model, name) for name in _TOP_TENSORS if hasattr(model, name)}
    for name, var in vars(model.layers).items():
        if isinstance(var, nnx.Param) and not isinstance(var, LoraParam):
            out[f"layers.{name}"] = var
    return out


def _layer_indices(short: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The model layers a stacked layer parameter covers, in stacking order."""
    return stacked_over(cfg, short)


def _hf_names(our_name: str, cfg: ModelConfig) -> list[str]:
    if our_name.startswith("layers."):
        short = our_name.removeprefix("layers.")
        if short in _EXPERT_TENSORS:
            return [
                f"model.layers.{i}.{suffix.format(e=e)}"
                for i in _layer_indices(short, cfg)
                for e in range(cfg.num_experts)
                for suffix, _ in _EXPERT_TENSORS[short]
            ]
        suffix = cfg.family.tensor_names.get(short, _LAYER_TENSORS[short][0])
        return [f"model.layers.{i}.{suffix}" for i in _layer_indices(short, cfg)]
    return [_TOP_TENSORS[our_name][0]]


def hf_tensor_plan(
    model: Transformer, cfg: ModelConfig
) -> list[tuple[nnx.Variable, list[str], Callable, int]]:
    """(our parameter, its HF names, converter, tensors per slice) in export order, the order of
    `state_to_hf_tensors`. A layer parameter is stacked over layers and its converter maps one layer's slice
    to that layer's HF tensors, stacked when there are several (MoE experts: expert-major, then gate/up);
    a top-level parameter has one name and its converter maps it whole."""
    plan = []
    for our_name, var in param_variables(model).items():
        short = our_name.removeprefix("layers.")
        names = _hf_names(our_name, cfg)
        if short in _EXPERT_TENSORS:
            pairs = _EXPERT_TENSORS[short]

            def experts(w, c, pairs=pairs):
                return jnp.stack([to_hf(w, e) for e in range(c.num_experts) for _, to_hf in pairs])

            plan.append((var, names, experts, cfg.num_experts * len(pairs)))
        elif our_name.startswith("layers."):
            plan.append((var, names, _LAYER_TENSORS[short][1], 1))
        else:
            plan.append((var, names, _TOP_TENSORS[our_name][1], 1))
    return plan


def export_dtype(our_name: str, dtype: str) -> str:
    """The dtype parameter `our_name` ("layers.q_proj", ...) is exported in when the export dtype is `dtype`."""
    return "float32" if our_name.removeprefix("layers.") in FP32_TENSORS else dtype


def _to_numpy(x: jax.Array, dtype) -> np.ndarray:
    if dtype is not None and x.dtype != dtype:
        x = x.astype(dtype)  # cast on device: halves the transfer for bf16 export
    if not x.is_fully_addressable:
        # Sharded over several processes (multi-host): a collective, so every process must iterate the
        # tensors in the same order (`state_to_hf_tensors`), though only one writes them.
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def state_to_hf_tensors(
    model: Transformer, cfg: ModelConfig, dtype: str | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, host array) one tensor at a time; `dtype=None` keeps the parameters' dtype.

    With parameters sharded over several processes each tensor is gathered collectively: every process must
    exhaust this iterator (`gather_for_export` on the ones that do not write).
    """
    jdtype = None if dtype is None else jnp.dtype(dtype)
    for our_name, var in param_variables(model).items():
        short = our_name.removeprefix("layers.")
        value = _to_numpy(var[...], jnp.dtype(jnp.float32) if short in FP32_TENSORS and jdtype else jdtype)
        if short in _EXPERT_TENSORS:
            names = iter(_hf_names(our_name, cfg))
            for layer_value in value:
                for e in range(cfg.num_experts):
                    for _, to_hf in _EXPERT_TENSORS[short]:
                        yield next(names), np.ascontiguousarray(to_hf(layer_value, e))
        elif our_name.startswith("layers."):
            to_hf = _LAYER_TENSORS[our_name.removeprefix("layers.")][1]
            for hf_name, layer_value in zip(_hf_names(our_name, cfg), value, strict=True):
                yield hf_name, np.ascontiguousarray(to_hf(layer_value, cfg))
        else:
            yield _TOP_TENSORS[our_name][0], np.ascontiguousarray(_TOP_TENSORS[our_name][1](value, cfg))


def gather_for_export(model: Transformer, cfg: ModelConfig, dtype: str | None = None) -> None:
    """A non-writing process's part of a multi-host `export_safetensors`: join every tensor's gather."""
    for _ in state_to_hf_tensors(model, cfg, dtype):
        pass


def hf_tensors_to_state(
    get_tensor: Callable[[str], np.ndarray],
    model: Transformer,
    cfg: ModelConfig,
    mesh: Mesh | None = None,
) -> Transformer:
    """Fill every parameter of `model` (concrete or abstract, from `nnx.eval_shape`) from HF tensors.

    Each parameter is assembled on the host from its HF tensors and placed directly with its rule-given
    sharding (each device receives only its shard). Returns the same model object.
    """
    for our_name, var in param_variables(model).items():
        dtype = np.dtype(var.dtype)
        names = _hf_names(our_name, cfg)
        short = our_name.removeprefix("layers.")
        if short in _EXPERT_TENSORS:
            host = _read_experts(get_tensor, short, var.shape, dtype, cfg)
        elif our_name.startswith("layers."):
            from_hf = _LAYER_TENSORS[our_name.removeprefix("layers.")][2]
            host = np.empty(var.shape, dtype)
            for i, name in enumerate(names):
                host[i] = from_hf(get_tensor(name), cfg)
        else:
            host = np.asarray(_TOP_TENSORS[our_name][2](get_tensor(names[0]), cfg), dtype)
        if host.shape != tuple(var.shape):
            raise ValueError(f"{names[0]}: shape {host.shape} after conversion, expected {tuple(var.shape)}")
        if mesh is None:
            var.set_value(jnp.asarray(host))
        else:
            sharding = NamedSharding(mesh, param_spec(var, mesh))
            var.set_value(jax.make_array_from_callback(host.shape, sharding, lambda idx, h=host: h[idx]))
        del host
    return model


def _read_experts(get_tensor, short: str, shape, dtype, cfg: ModelConfig) -> np.ndarray:
    """One stacked expert parameter from per-expert HF tensors, or from transformers' fused form."""
    host = np.empty(shape, dtype)
    for j, i in enumerate(cfg.sparse_layers()):
        fused_name, from_fused = _FUSED_EXPERTS[short]
        try:
            fused = get_tensor(f"model.layers.{i}.{fused_name}")
        except KeyError:
            fused = None
        if fused is not None:
            host[j] = from_fused(fused, cfg)
            continue
        for e in range(cfg.num_experts):
            for k, (suffix, _) in enumerate(_EXPERT_TENSORS[short]):
                w = get_tensor(f"model.layers.{i}.{suffix.format(e=e)}").T
                if short == "experts_gate_up":
                    host[j, e, :, k, :] = w
                else:
                    host[j, e] = w
    return host


class _SafetensorsReader:
    """Tensors by name across the single-file or sharded (index json) layouts of an HF directory."""

    def __init__(
        self, model_dir: str | os.PathLike, stored_name: Callable[[str, dict], str] = lambda n, m: n
    ):
        self.dir = Path(model_dir)
        self._stored_name = stored_name  # the family's: where a wrapper checkpoint keeps the tensor
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in model directory {str(model_dir)!r}")
        self._handles = {f: safe_open(self.dir / f, framework="numpy") for f in files}
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self.weight_map: dict[str, str] = weight_map

    def __call__(self, name: str) -> np.ndarray:
        name = self._stored_name(name, self.weight_map)  # e.g. a multimodal checkpoint's language model
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not found in the safetensors of {str(self.dir)!r}")
        return self._handles[self.weight_map[name]].get_tensor(name)


def load_model(
    model_dir: str | os.PathLike, *, mesh: Mesh | None = None, **cfg_overrides
) -> tuple[Transformer, ModelConfig]:
    """Build the model described by `model_dir/config.json` and load its safetensors weights (sharded)."""
    cfg = ModelConfig.from_model_dir(model_dir, **cfg_overrides)
    reader = _SafetensorsReader(model_dir, cfg.family.stored_name)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return hf_tensors_to_state(reader, model, cfg, mesh), cfg


def abstract_model(cfg: ModelConfig) -> Transformer:
    """A Transformer whose parameters are shape/dtype placeholders (no memory): a template to fill."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def plan_files(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """The export's safetensors files: tensor names per file, in order (shared with transfer/fs_export.py)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def export_safetensors(
    model: Transformer,
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    dtype: str | None = "bfloat16",
    src_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 2**30,
    writer: tuple[int, int] = (0, 1),
    tensors: list[tuple[str, np.ndarray]] | None = None,
) -> dict:
    """Write the model as an HF directory into `out_dir` (created if needed; the caller makes it atomic).

    Files: model-0000x-of-0000y.safetensors, model.safetensors.index.json, config.json, plus generation
    config and tokenizer files copied from `src_dir` when present. `dtype=None` keeps the parameter dtype.
    `writer` = (index, count): with several writing processes (multi-host, a shared directory), safetensors
    file i is written by writer i % count and writer 0 writes the index and config; every writer must call
    this (each tensor's gather is collective) and each holds at most one stacked tensor plus its own open
    file's tensors. `tensors`: the `state_to_hf_tensors(model, cfg, dtype)` output when the caller already
    materialized it (one process). Returns {"bytes" (total), "bytes_written" (this writer's), "seconds", "files"}.
    """
    rank, writers = writer
    start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    variables = param_variables(model)
    itemsize = {
        k: (np.dtype(v.dtype) if dtype is None else np.dtype(_NP_DTYPES[export_dtype(k, dtype)])).itemsize
        for k, v in variables.items()
    }
    sizes = []
    for our_name, var in variables.items():
        per_tensor = int(np.prod(var.shape)) * itemsize[our_name]
        names = _hf_names(our_name, cfg)
        sizes += [(n, per_tensor // len(names)) for n in names]
    shards = plan_files(sizes, max_shard_bytes)
    file_of = {
        n: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards) for n in s
    }

    pending: dict[str, np.ndarray] = {}
    total = written = 0
    shard_idx = 0
    for name, array in tensors if tensors is not None else state_to_hf_tensors(model, cfg, dtype):
        total += array.nbytes
        mine = shard_idx % writers == rank
        if mine:
            pending[name] = array
            written += array.nbytes
        # Tensors arrive in plan order, so a shard is complete when its last planned tensor arrives.
        if name == shards[shard_idx][-1]:
            if mine:
                save_file(pending, str(out_dir / file_of[name]), metadata={"format": "pt"})
            pending = {}
            shard_idx += 1
    assert not pending and shard_idx == len(shards)
    info = {"bytes": total, "bytes_written": written, "files": len(shards)}
    if rank != 0:
        return dict(info, seconds=time.perf_counter() - start)

    stored = dtype or str(np.dtype(next(iter(variables.values())).dtype))
    write_export_metadata(out_dir, cfg, file_of, total, stored, src_dir)
    return dict(info, seconds=time.perf_counter() - start)


def write_export_metadata(
    out_dir: Path, cfg: ModelConfig, weight_map: dict[str, str], total: int, stored: str, src_dir: Any
) -> None:
    """The index, config.json and the source's generation/tokenizer files of an export (one writer)."""
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf_config(dtype=stored), indent=2) + "\n")
    if src_dir is not None:
        for fname in AUX_FILES:
            if (Path(src_dir) / fname).is_file():
                shutil.copy2(Path(src_dir) / fname, out_dir / fname)
