"""End to end on CPU with the real vLLM server: three reverse-text steps, a fake trainer broadcasting
perturbed weights, the orchestrator loading them into the server and tagging samples with their version."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
from orch_fakes import make_orchestrator, small_config

from primejax.contracts.batch import read_batch, step_dir
from primejax.contracts.broadcast import write_broadcast
from primejax.inference.client import InferenceClient
from primejax.orchestrator.renderer import load_tokenizer

pytestmark = pytest.mark.vllm
STEPS = 3


class RecordingClient(InferenceClient):
    """The real client, remembering every completion the server returned."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.completions = []

    async def generate(self, prompt_token_ids, **kw):
        out = await super().generate(prompt_token_ids, **kw)
        self.completions += out
        return out


def write_perturbed(model_dir: Path, out: Path, seed: int) -> None:
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(seed)
    for f in model_dir.glob("*.safetensors"):
        tensors = {k: (v + 0.02 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in load_file(f).items()}
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    for name in ("config.json", "model.safetensors.index.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)


async def fake_trainer(run_dir: Path, model_dir: Path) -> None:
    for n in range(1, STEPS + 1):
        while not step_dir(run_dir, n).exists():
            await asyncio.sleep(0.05)
        write_broadcast(run_dir, n, lambda d, n=n: write_perturbed(model_dir, d, seed=n))


def test_reverse_text_steps_against_vllm_with_weight_updates(tmp_path, vllm_server, tiny_model_dir):
    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, batch_size=8, group_size=4, async_level=1)
    cfg.model.path = str(tiny_model_dir)
    cfg.orchestrator.update({"seq_len": 512, "max_prompt_tokens": 256})
    cfg.orchestrator.sampling.max_tokens = 24  # unseeded: seeds need async_level 0 (config rule)
    cfg.orchestrator.filters.post_batch = ()  # a random tiny model's rewards may tie; ship everything
    tokenizer = load_tokenizer(str(tiny_model_dir))

    async def main():
        client = RecordingClient(vllm_server.base_url, timeout_s=120, max_retries=2)
        probe = list(range(3, 40))
        try:
            before = await client.score(probe)
            orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=run_dir)
            await orch.tracker.sync_with_server()
            history = (await asyncio.gather(orch.run(STEPS), fake_trainer(run_dir, tiny_model_dir)))[0]
            await orch.tracker.refresh()  # pick up the last broadcast too
            after = await client.score(probe)
            version = await client.weights_version()
            return client.completions, history, before, after, version
        finally:
            await client.reload_weights()  # the server is shared by the session: leave it as we found it
            await client.close()

    completions, history, before, after, version = asyncio.run(main())
    assert version == STEPS
    assert not np.allclose(np.array(before[1:]), np.array(after[1:]), atol=1e-4)  # the weights really changed
    served = {tuple(c.prompt_token_ids + c.completion_token_ids): c for c in completions}
    versions = []
    for n in range(1, STEPS + 1):
        batch = read_batch(step_dir(run_dir, n) / "rank_0.npz", vocab_size=len(tokenizer))
        assert batch.meta["num_samples"] == 8
        versions.append(batch.meta["min_policy_version"])
        for row in range(batch.rows):
            for seg in range(1, int(batch.segment_ids[row].max()) + 1):
                sel = batch.segment_ids[row] == seg
                tokens = tuple(batch.tokens[row, sel].tolist())
                c = served[tokens]  # token ids equal the server's, prompt and completion
                mask = batch.loss_mask[row, sel]
                assert mask.sum() == len(c.completion_token_ids) and not mask[: len(c.prompt_token_ids)].any()
                lps = batch.inference_logprobs[row, sel][mask]
                np.testing.assert_allclose(lps, np.float32(c.completion_logprobs), rtol=0, atol=0)
                assert np.isfinite(lps).all() and (lps <= 0).all() and (lps < 0).any()
    # k = 1: step 3 must sample θ_1 or newer; the tags never go backwards.
    assert versions[0] == 0 and versions[2] >= 1 and versions == sorted(versions)
    assert all(m["staleness/max"] <= 1 for m in history)
