"""The model families, one file each; importing this package registers them all (families/base.py)."""

from primejax.models.families import deepseek_v3, glm4_moe, llama, qwen2, qwen3, qwen3_5, qwen3_moe  # noqa: F401
from primejax.models.families.base import FAMILIES, WRAPPERS, Family, family_of, register

__all__ = ["FAMILIES", "WRAPPERS", "Family", "family_of", "register"]
