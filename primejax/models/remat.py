"""Remat policies of one decoder layer (ModelConfig.remat_policy; the names and what each keeps: config.py
`REMAT_POLICIES`, docs/memory.md): which of a layer's values its backward pass reuses, recomputes or brings
back from pinned host memory.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import Offloadable

from primejax.models.attention import resolve_impl
from primejax.models.gmm import GMM_OUTPUTS
from primejax.models.moe import EXPERTS_GATHERED
from primejax.models.moe_a2a import EXCHANGED
from primejax.models.splash_attention import RESIDUALS as SPLASH_RESIDUALS

ATTN_OUT = "attn_out"  # checkpoint name of the attention output (the xla path's saveable result)


def _saves_attention(prim, *args, **params) -> bool:
    """Keep the attention kernel's results for the backward pass instead of re-running it.

    Under remat the policy sees the primitives inside a custom_vjp's forward rule, so cuDNN's fused forward
    (output + softmax statistics, the residuals its backward kernel needs) is saved by primitive name; the
    xla path's output by its checkpoint name, and the splash kernel's residuals by theirs. Attention is the
    one part of a layer whose recompute costs O(T^2), so at long context this removes most of full remat's
    extra work for a few [T, H, Dh] per layer.
    """
    if prim.name.startswith("dot_product_attention_fwd"):
        return True
    return jax.checkpoint_policies.save_only_these_names(ATTN_OUT, SPLASH_RESIDUALS)(prim, *args, **params)


def _saves_attention_and_weight_dots(prim, *args, **params) -> bool:
    """Attention's results and every weight matmul's output, the experts' grouped matmuls included."""
    return (
        _saves_attention(prim, *args, **params)
        or jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
        or jax.checkpoint_policies.save_only_these_names(*GMM_OUTPUTS)(prim, *args, **params)
    )


def _offloads_attention(cudnn: bool):
    """`attn`, but the attention results go to pinned host memory instead of staying on the device.

    At 64k+ tokens per device the saved attention outputs are half of all residuals (Qwen3-8B: 8 kB per token
    per layer, 19 GB at 64k); offloaded, the device keeps only each layer's input, at `full` remat's memory
    without its recompute of the attention forward. The copies (one out and back per layer) ride PCIe
    alongside the layer's compute. On the cudnn path the kernel's results (output + softmax statistics) are
    offloaded, elsewhere the named output; not both, which would copy the output twice.
    """

    def policy(prim, *args, **params):
        if (
            prim.name.startswith("dot_product_attention_fwd")
            if cudnn
            else (prim.name == "name" and params.get("name") == ATTN_OUT)
        ):
            return Offloadable(src="device", dst="pinned_host")
        return False

    return policy


def _saves_attention_offloads_experts(prim, *args, **params):
    """`attn`, and the experts' gate/up grouped-matmul output goes to pinned host memory in the forward and comes
    back for the backward instead of being recomputed.

    Under `full` or `attn` remat the backward re-runs both grouped matmuls of every MoE layer; the gate/up one is
    two thirds of the experts' FLOPs. Its output is 2 x moe_intermediate_size bf16 values per routed row: 24.6 kB
    per token per layer for Qwen3-30B-A3B (top-8), 18 GiB at 48 layers and 16k tokens per device, memory that fp32
    optimizer state needs. Offloaded it rides the host link, which carries the offloaded optimizer state only
    during the update: ~35 GB/s one way if the forward is a quarter of the step (2.2 s at that shape), under the
    ~53 GB/s one direction runs at (docs/benchmarks.md). The down projection's output stays recomputed: keeping
    it too would more than double the traffic, and the forward would wait on the link. Measured on 2 x H200 it is
    slower than `attn` (864 against 752 ms per step): the copies are not hidden (docs/memory.md).
    """
    if _saves_attention(prim, *args, **params):
        return True
    if prim.name == "name" and params.get("name") == GMM_OUTPUTS[0]:
        return Offloadable(src="device", dst="pinned_host")
    return False


def _also_saves(policy, name: str):
    """`policy` (None: save nothing), and the values named `name` saved too. Not jax's save_from_both_policies,
    which refuses a policy that offloads (returns Offloadable, not a bool)."""
    named = jax.checkpoint_policies.save_only_these_names(name)

    def fn(prim, *args, **params):
        return named(prim, *args, **params) or (policy is not None and policy(prim, *args, **params))

    return fn


_REMAT_POLICIES = {
    "full": None,  # jax.checkpoint with no policy saves nothing but the inputs
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attn": _saves_attention,
    "dots_no_batch_attn": _saves_attention_and_weight_dots,
    "attn_experts_offload": _saves_attention_offloads_experts,
}
# "auto": save the weight matmuls' outputs as well as attention's up to 32k tokens per micro-batch (it writes
# fewer fp32 temporaries than plain autodiff keeps, so it is also faster than no remat), but that costs ~1 GiB
# per 1k tokens; beyond it keep only attention's outputs and re-run the cheap matmuls (docs/benchmarks.md).
AUTO_REMAT_MAX_TOKENS_FOR_DOTS = 32768


def resolve_remat_policy(policy: str, tokens: int) -> str:
    """The policy that runs for `policy` on a micro-batch of `tokens` tokens ("auto" picks by size)."""
    if policy != "auto":
        return policy
    return "dots_no_batch_attn" if tokens <= AUTO_REMAT_MAX_TOKENS_FOR_DOTS else "attn"


def layer_policy(cfg, policy: str, dtype):
    """The jax.checkpoint policy of one layer for the resolved `policy` (not "none"; None: save nothing but
    the inputs), with the kept transfers `cfg` asks for (keep_gathered_experts, keep_exchanged_tokens)."""
    if policy == "attn_offload":
        fn = _offloads_attention(resolve_impl(cfg.attention_impl, dtype) == "cudnn")
    else:
        fn = _REMAT_POLICIES[policy]
    if cfg.keep_gathered_experts:
        fn = _also_saves(fn, EXPERTS_GATHERED)
    if cfg.keep_exchanged_tokens:
        fn = _also_saves(fn, EXCHANGED)
    return fn
