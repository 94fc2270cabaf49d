"""A small config for checking a set-up: tiny local model, few steps."""

from primejax.config import default_config


def get_config():
    c = default_config()
    c.run.name = "debug"
    c.run.max_steps = 5
    c.model.path = "outputs/models/tiny-qwen3"
    c.model.build_tiny.enabled = True
    c.model.compute_dtype = (
        "float32"  # CPU: fp32 is faster than emulated bf16 and matches vLLM's fp32 serving
    )
    c.orchestrator.batch_size = 16
    c.orchestrator.group_size = 4
    # Room for a real taskset's prompt (verifiers' textarena Hangman opens with ~400 tokens of the tiny
    # tokenizer; a tool schema preamble takes ~1,100): `--dry_run` prints each env's first-prompt size.
    c.orchestrator.seq_len = 1280
    c.orchestrator.max_prompt_tokens = 1024
    c.orchestrator.sampling.max_tokens = 32
    c.inference.max_model_len = 1280
    return c
