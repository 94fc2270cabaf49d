"""Orbax save/restore of model parameters.

Parameters are stored as a nested dict of arrays keyed by the NNX attribute path (`embed`,
`layers/q_proj`, ...), the same stacked layout the model uses, so a restore is a straight (resharding)
read with no conversion. Orbax finalizes a checkpoint with an atomic rename: a reader never sees a
half-written one. Used by tools/convert_checkpoint.py; the trainer's full-state checkpoints (optimizer, step)
are primejax/trainer/checkpoint.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from primejax.models.config import ModelConfig
from primejax.models.hf_io import abstract_model
from primejax.models.sharding import param_spec

_is_var = lambda x: isinstance(x, nnx.Variable)


def _param_state(model_or_state: nnx.Module | nnx.State) -> nnx.State:
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    return model_or_state


def save_params(
    path: str | os.PathLike, model_or_state: nnx.Module | nnx.State, *, force: bool = False
) -> None:
    """Write the parameters (a model, or its `nnx.State`) to the Orbax checkpoint directory `path`."""
    pure = nnx.to_pure_dict(_param_state(model_or_state))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(Path(path).absolute(), pure, force=force)
    ckptr.wait_until_finished()


def saved_param_dtype(path: str | os.PathLike) -> str | None:
    """The dtype the embedding was saved in (read from Orbax metadata, no array data), or None if unknown."""
    meta = ocp.StandardCheckpointer().metadata(Path(path).absolute())
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    try:
        return str(tree["embed"].dtype)
    except (KeyError, TypeError, AttributeError):
        return None


def _abstract_leaf(var: nnx.Variable, mesh: Mesh | None) -> jax.ShapeDtypeStruct:
    if mesh is not None:
        sharding = NamedSharding(mesh, param_spec(var, mesh))
    else:
        sharding = getattr(var.get_value(), "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):  # abstract template: one device
            sharding = SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sharding)


def restore_params(
    path: str | os.PathLike,
    template: nnx.Module | nnx.State | ModelConfig,
    mesh: Mesh | None = None,
) -> Any:
    """Read parameters saved by `save_params`.

    `template` gives the structure, dtypes and (without `mesh`) the shardings: a Transformer (concrete or
    from `nnx.eval_shape`), its parameter `nnx.State`, or a ModelConfig. With `mesh`, arrays are placed by
    the sharding rules. Returns a new model for a Module or ModelConfig template, else a State.
    """
    if isinstance(template, ModelConfig):
        template = abstract_model(template)
    state = _param_state(template)
    abstract = jax.tree.map(lambda v: _abstract_leaf(v, mesh), state, is_leaf=_is_var)
    restored = ocp.StandardCheckpointer().restore(Path(path).absolute(), nnx.to_pure_dict(abstract))
    new_state = jax.tree.map(lambda v: v, state, is_leaf=_is_var)  # copy: never mutate the template
    nnx.replace_by_pure_dict(new_state, restored)
    if isinstance(template, nnx.Module):
        graphdef, _, rest = nnx.split(template, nnx.Param, ...)
        return nnx.merge(graphdef, new_state, rest)
    return new_state
