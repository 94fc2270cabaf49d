"""An MoE layer's experts into vLLM's fused expert parameters with one loader call per projection.

vLLM keeps a layer's experts as `w13_weight` [E, 2I, H] (gate rows, then up rows) and `w2_weight` [E, H, I];
its `load_weights` takes the checkpoint's per-expert tensors and calls the parameter's `weight_loader` once per
expert and projection (`RoutedExperts.load_weights`, vLLM 0.31), which during a layerwise reload runs twice
(counted on the meta device, then replayed): for Qwen3-30B-A3B that is 18,432 calls per update. The same
`weight_loader` also takes a whole projection at once (a 3-d tensor: its `full_load` branch copies into every
expert with one `copy_`), so here a layer's gate, up and down projections of all its experts are 3 calls.

The experts arrive as stacks (meta.py: consecutive tensors of one shape travel as one `[count, ...]` block) or
one by one; a projection's experts are gathered (views of the received buckets) until all E are there, then
loaded: without a copy when they arrived as one stack in expert order, else stacked once. Only where the layout is
known to match: unquantized experts, one tensor-parallel rank (a TP > 1 full load would narrow the
intermediate axis per rank, untested here), no expert parallelism (a full load writes every global expert),
the HF names `<layer>.experts.<e>.{gate,up,down}_proj.weight`. Everything else goes to the model's own
`load_weights`, tensor by tensor, as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# HF projection -> (vLLM parameter, the weight_loader's shard id)
_SHARDS = {
    "gate_proj": ("w13_weight", "w1"),
    "up_proj": ("w13_weight", "w3"),
    "down_proj": ("w2_weight", "w2"),
}


def _experts_module(model: Any, layer: str) -> Any:
    """The module holding `layer`'s fused expert parameters when a full-projection load is known to be right
    there, else None (module docstring)."""
    try:
        mod = model.get_submodule(layer)
    except AttributeError:
        return None
    mod = getattr(mod, "routed_experts", mod)  # vLLM 0.31: MoERunner -> RoutedExperts holds the parameters
    w13, w2 = getattr(mod, "w13_weight", None), getattr(mod, "w2_weight", None)
    cfg = getattr(mod, "moe_config", None)
    par = getattr(cfg, "moe_parallel_config", None)
    if w13 is None or w2 is None or par is None or not hasattr(w13, "weight_loader"):
        return None
    if getattr(par, "tp_size", 0) != 1 or getattr(par, "ep_size", 0) != 1 or w13.dim() != 3:
        return None
    if type(getattr(mod, "quant_method", None)).__name__ != "UnquantizedFusedMoEMethod":
        return None
    if getattr(mod, "ckpt_gate_proj_name", "gate_proj") != "gate_proj" or not getattr(
        cfg, "is_act_and_mul", True
    ):
        return None
    return mod


class ExpertLoader:
    """`load(pairs)` and `load.stacked(names, tensor)` for `wire.receive_units`: experts of eligible layers go
    into the fused parameters per projection, everything else to `load_weights` (module docstring)."""

    def __init__(self, model: Any, load_weights: Callable[[list[tuple[str, Any]]], Any]):
        self.model, self.load_weights = model, load_weights
        self.modules: dict[str, Any] = {}
        self.pending: dict[tuple[str, str], dict[int, Any]] = {}  # (layer, proj) -> first expert -> [n, ...]
        self.fused_calls = 0

    def _module(self, layer: str) -> Any:
        if layer not in self.modules:
            self.modules[layer] = _experts_module(self.model, layer)
        return self.modules[layer]

    def __call__(self, pairs: Sequence[tuple[str, Any]]) -> None:
        rest = []
        for name, t in pairs:
            m = _EXPERT.match(name)
            if m is None or (mod := self._module(m["layer"])) is None:
                rest.append((name, t))
                continue
            self._add(mod, m["layer"], m["proj"], int(m["e"]), t.unsqueeze(0))
        if rest:
            self.load_weights(rest)

    def stacked(self, names: Sequence[str], tensor: Any) -> None:
        """`tensor[j]` is `names[j]`: each run of one layer's consecutive experts of one projection goes in as
        a view of the stack; anything else tensor by tensor."""
        rest, j = [], 0
        while j < len(names):
            m = _EXPERT.match(names[j])
            if m is None or (mod := self._module(m["layer"])) is None:
                rest.append((names[j], tensor[j]))
                j += 1
                continue
            layer, proj, e, k = m["layer"], m["proj"], int(m["e"]), j + 1
            while k < len(names) and names[k] == f"{layer}.{e + k - j}.{proj}.weight":
                k += 1
            self._add(mod, layer, proj, e, tensor[j:k])
            j = k
        if rest:
            self.load_weights(rest)

    def _add(self, mod: Any, layer: str, proj: str, e: int, t: Any) -> None:
        """Gather experts e..e+len(t)-1 of a projection (t: [count, ...]); load it once all E are there."""
        import torch

        param_name, shard = _SHARDS[proj]
        param = getattr(mod, param_name)
        experts = param.shape[0]
        if not 0 <= e and e + t.shape[0] <= experts:
            raise ValueError(f"{layer}: experts {e}..{e + t.shape[0] - 1} received for a layer of {experts}")
        got = self.pending.setdefault((layer, proj), {})
        got[e] = t
        if sum(x.shape[0] for x in got.values()) < experts:
            return
        del self.pending[(layer, proj)]
        at = 0
        for k in sorted(got):  # contiguous: no expert twice, none missing
            if k != at:
                raise ValueError(f"{layer}.{proj}: overlapping experts received (at expert {k})")
            at += got[k].shape[0]
        parts = [got[k] for k in sorted(got)]
        # In expert order as one stack: a view of the bucket, no copy; in several pieces: one copy.
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
        # vLLM's own loader in its full-projection branch (a 3-d tensor), through the layerwise-reload wrapper.
        param.weight_loader(
            param=param,
            loaded_weight=whole,
            weight_name=f"{layer}.{param_name}",
            shard_id=shard,
            expert_id=0,
            return_success=True,
        )
        self.fused_calls += 1

    def check_done(self) -> None:
        """Every gathered projection was loaded (a round that ends with part of one is refused)."""
        if self.pending:
            (layer, proj), got = next(iter(self.pending.items()))
            raise ValueError(f"round ended with {layer}.*.{proj} partly received ({len(got)} experts)")
