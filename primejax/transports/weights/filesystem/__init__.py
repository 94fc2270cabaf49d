"""The filesystem transport: broadcasts/step_N (HF safetensors + STABLE), written by the trainer, loaded by path."""
