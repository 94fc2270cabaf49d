"""transformers as the reference the server is checked against, and weight-directory fixtures for updates."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

# Files copied next to new weights: what a trainer broadcast carries besides the tensors.
_SIDE_FILES = ("config.json", "generation_config.json")


class HFReference:
    """A transformers model (fp32) loaded from a directory; teacher-forced log-probabilities."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(
        self, prompt: list[int], completion: list[int], temperature: float = 1.0
    ) -> tuple[np.ndarray, np.ndarray]:
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
    """Load `base_dir` into primejax, perturb every parameter in JAX, export it with primejax to `out_dir`.

    This is the trainer's path (JAX params -> `export_safetensors`), kept in fp32 so transformers on the
    exported files is an exact reference. Each weight gets noise of its own magnitude (at least 0.1, so
    norm weights change too), which moves greedy outputs and logprobs clearly away from the base model;
    for a tied model that includes the embedding the LM head shares.
    """
    import jax

    from primejax.models.hf_io import export_safetensors, load_model, param_variables

    model, cfg = load_model(base_dir, param_dtype="float32")
    key = jax.random.key(seed)
    for i, var in enumerate(param_variables(model).values()):
        w = var[...]
        sd = max(float(w.std()), 0.1)
        var[...] = w + scale * sd * jax.random.normal(jax.random.fold_in(key, i), w.shape, w.dtype)
    export_safetensors(model, cfg, out_dir, dtype="float32", src_dir=base_dir)
    return out_dir


def copy_checkpoint(base_dir: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in [*base_dir.glob("*.safetensors"), *(base_dir / n for n in _SIDE_FILES)]:
        if f.exists():
            shutil.copy(f, out_dir / f.name)
    return out_dir
