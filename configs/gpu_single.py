"""RL on one GPU shared by the trainer and vLLM (docs/gpu.md): the reverse-text task on a model with Qwen3-0.6B's
body (28 layers, width 1024, 16 query / 8 key-value heads of 128, MLP 3072) and the demo's byte vocabulary, built
locally at random init; an SFT warm-up on demonstrations, then RL (GRPO advantages, DPPO+KL) with continuous
rollouts and AIMD concurrency.

    python -m primejax.train --config configs/gpu_single.py

The launcher places both processes on the one GPU (launcher/placement.py): vLLM starts first with 45% of the card,
then the trainer's JAX takes 45%; weights reach vLLM through the filesystem (NCCL cannot join two processes on one
GPU). Measured on one H200: docs/benchmarks.md ("GPU end to end").
"""

from pathlib import Path

from primejax.config.cli import load_config_file


def get_config():
    c = load_config_file(Path(__file__).with_name("demo.py"))
    c.run.name = "gpu_single"

    c.model.path = "outputs/models/qwen3-0.6b-body-bytes"
    t = c.model.build_tiny
    t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim = 1024, 28, 16, 8, 128
    t.intermediate_size = 3072
    c.model.compute_dtype = "bfloat16"  # fp32 master weights and moments, bf16 matmuls
    c.trainer.micro_batch_size = 32

    c.orchestrator.envs.reverse_text.args = {"system_prompt": "", "min_len": 3, "max_len": 8}
    c.orchestrator.pool.mode = "continuous"
    c.orchestrator.concurrency.mode = "aimd"
    c.orchestrator.max_concurrent = 512
    c.orchestrator.sampling.max_tokens = 16

    # Measured on an H200 (docs/benchmarks.md, "GPU end to end"): 60 SFT steps at 3e-4 left the 0.44B model at
    # reward 0.14 and RL at 5e-5 did not move it; 200 steps start RL at ~0.87, and 1e-4 climbs to ~0.91 by step 30.
    c.run.max_steps = 30
    c.sft.steps = 200
    c.sft.lr = 3e-4
    c.trainer.optim.lr = 1e-4

    c.inference.dtype = "bfloat16"
    c.inference.startup_timeout_s = 600.0
    return c
