"""MoE RL with routing replay on two GPUs (docs/gpu.md, docs/moe.md): Qwen3-30B-A3B's layer (width 2048, 32 query /
4 key-value heads of 128, 128 experts of width 768, 8 per token) cut to 4 layers (2.5B parameters) with the byte
vocabulary, built locally; the trainer on GPU 0, vLLM on GPU 1 returning each token's routed experts, which the
trainer replays (the same experts in the policy's forward as in the sampler's).

    python -m primejax.train --config configs/gpu_moe.py
"""

from pathlib import Path

from primejax.config.cli import load_config_file


def get_config():
    c = load_config_file(Path(__file__).with_name("gpu_single.py"))
    c.run.name = "gpu_moe"
    c.model.path = "outputs/models/qwen3-30b-a3b-4layers-bytes"
    t = c.model.build_tiny
    t.family = "qwen3_moe"
    t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim = 2048, 4, 32, 4, 128
    t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size = 128, 8, 768
    c.orchestrator.routing_replay = True
    c.inference.return_routed_experts = True
    c.trainer.devices = "0"
    c.inference.devices = "1"
    c.trainer.broadcast.mode = "collective"
    return c
