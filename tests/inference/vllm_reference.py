"""transformers as the reference the server is checked against, and weight-directory fixtures for updates."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

# Files copied next to new weights: what a trainer broadcast carries besides the tensors.
_SIDE_FILES = ("config.json", "generation_config.json")


class HFReference:
    """A transformers model (fp32) loaded from a directory; teacher-forced log-probabilities."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(self, prompt: list[int], completion: list[int], temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(log p(completion_t | ...) after temperature, argmax ids at each completion position)."""
        ids = torch.tensor([prompt + completion])
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1].double()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        chosen = lp.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        return chosen.numpy(), logits.argmax(-1).numpy()

    @torch.no_grad()
    def prompt_logprobs(self, ids: list[int]) -> np.ndarray:
        logits = self.model(torch.tensor([ids])).logits[0, :-1].double()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def write_perturbed(base_dir: Path, out_dir: Path, seed: int, scale: float = 1.0) -> Path:
    """Copy `base_dir`'s checkpoint to `out_dir` with every tensor visibly changed (norm weights included).

    Each weight gets noise of its own magnitude (at least 0.1), so greedy outputs and logprobs differ
    clearly from the base model's; for a tied model that includes the embedding the LM head shares.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for f in sorted(base_dir.glob("*.safetensors")):
        tensors = load_file(str(f))
        new = {}
        for name, w in tensors.items():
            sd = max(float(w.std()), 0.1)
            new[name] = (w + scale * sd * rng.standard_normal(w.shape)).astype(w.dtype)
        save_file(new, str(out_dir / f.name), metadata={"format": "pt"})
    for name in _SIDE_FILES:
        if (base_dir / name).exists():
            shutil.copy(base_dir / name, out_dir / name)
    return out_dir


def copy_checkpoint(base_dir: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in [*base_dir.glob("*.safetensors"), *(base_dir / n for n in _SIDE_FILES)]:
        if f.exists():
            shutil.copy(f, out_dir / f.name)
    return out_dir
