"""Qwen3-30B-A3B RL on one 8-GPU node (H100/H200 SXM): the trainer on GPUs 0-3 with fp32 master weights and fp32
AdamW moments, vLLM on GPUs 4-7 (two replicas, tensor parallel 2).

    python -m primejax.train --config configs/qwen3_30b_a3b.py --config.model.path=/models/Qwen3-30B-A3B

UNTESTED END TO END. The trainer's settings are the ones docs/benchmarks.md measured on 4 × H200 for the 48-layer
step (27.5% MFU, a 1M-token step in 36 s: "GPU rows, 2026-11-28, seventh session"). This repository's machines
have no GPU build of vLLM, so inference, orchestrator and trainer have not run together on GPUs. Replace the
environment (`orchestrator.envs`) with your verifiers environment.

Why these settings (docs/memory.md, docs/moe.md):
- fp32 master + moments are 16 B/param (490 GB): more than 4 GPUs hold beside the activations. The master stays
  on the GPUs (30.5 GB each), and the moments rest in pinned host memory except 15 GiB per GPU; the update
  streams them in 2 GiB buckets, two in flight. The host needs ~8 B/param (~245 GB) of RAM it can pin.
- JAX may take 95% of each trainer GPU (the step peaks at 125 GiB of 141 on an H200; JAX's default is 75%).
  An 80 GB H100 does not hold this step: use 8 trainer GPUs there.
- remat `attn`: the attention kernel's outputs are kept and the rest recomputed.
- Experts `fsdp`: within one NVLink host it measured faster than the all-to-all mode (docs/moe.md).
- One 16k row per GPU per micro-batch: a step of 64 rows runs 16 micro-batches, which spreads the update's
  host traffic over 1M tokens.
"""

from primejax.config import default_config


def get_config():
    c = default_config()
    c.run.name = "qwen3-30b-a3b"
    c.run.max_steps = 500
    c.model.path = "/models/Qwen3-30B-A3B"  # an HF directory: config.json, safetensors, tokenizer
    c.model.param_dtype = "bfloat16"  # the GPUs' compute copies; the fp32 master is the offload's
    c.model.compute_dtype = "bfloat16"
    c.model.remat_policy = "attn"
    c.model.scan_layers = True
    c.model.expert_parallel = "fsdp"

    c.trainer.devices = "0,1,2,3"
    c.trainer.memory_fraction = 0.95
    c.trainer.mesh.fsdp = -1
    c.trainer.micro_batch_size = 1
    c.trainer.logprob_chunk_size = 2048
    c.trainer.optim.lr = 1e-6
    c.trainer.optim.offload = True
    c.trainer.optim.offload_master = False
    c.trainer.optim.offload_bucket_mb = 2048.0
    c.trainer.optim.offload_inflight = 2
    c.trainer.optim.offload_resident_gib = 15.0
    c.trainer.broadcast.dtype = "bfloat16"

    c.inference.devices = "4,5,6,7"
    c.inference.replicas = 2
    c.inference.tensor_parallel_size = 2
    c.inference.dtype = "bfloat16"
    c.inference.enforce_eager = False
    c.inference.gpu_memory_utilization = 0.9
    c.inference.max_model_len = 16384
    c.inference.startup_timeout_s = 900.0  # loading 61 GB of weights and capturing CUDA graphs

    # the default environment (reverse-text); replace it with yours: c.orchestrator.envs = {"math": env("...")}
    c.orchestrator.seq_len = 16384
    c.orchestrator.batch_size = 128
    c.orchestrator.group_size = 8
    c.orchestrator.max_prompt_tokens = 2048
    c.orchestrator.sampling.max_tokens = 8192
    return c
