"""Supervised fine-tuning (`python -m primejax.sft`): chat data or an environment's answers, the trainer's step."""
