"""Semantics the reference states: rollouts an enforcing pre-batch filter drops are replaced (the batch stays
full), online evals run next to training requests (the step does not wait for them), and per-env mixture
weights set the share of each step's prompts."""

from __future__ import annotations

import asyncio

from ml_collections import ConfigDict
from orch_fakes import FakeClient, make_orchestrator, small_config

from primejax.config import _env
from primejax.envs.base import Environment, Example
from primejax.envs.registry import register_env
from primejax.envs.reverse_text import ReverseText
from primejax.orchestrator.buffer import Buffer, EnvSlot


class HalfGibberish(FakeClient):
    """Members 2 and 3 of every group sample at logprob -20 (the gibberish filter's prey)."""

    async def generate(self, prompt_token_ids, *, n, **kw):
        out = await super().generate(prompt_token_ids, n=n, **kw)
        for member, c in enumerate(out):
            if member >= 2:
                c.completion_logprobs = [-20.0] * len(c.completion_logprobs)
        return out


def test_enforced_pre_batch_filter_drops_are_replaced_and_the_batch_stays_full(tmp_path, tokenizer):
    cfg = small_config(tmp_path / "run", batch_size=16, group_size=4)
    cfg.orchestrator.filters.update(
        {"pre_batch": ("gibberish",), "pre_batch_enforce": True, "post_batch": ()}
    )
    orch = make_orchestrator(
        cfg, client=HalfGibberish(tokenizer), tokenizer=tokenizer, run_dir=tmp_path / "run"
    )
    (m,) = asyncio.run(orch.run(1))
    assert m["filters/pre_batch/dropped"] >= 8  # half of the first round's 16 rollouts
    assert m["batch/rollouts"] == 16 and m["samples/count"] == 16  # replaced: a full batch (was 8 of 16)
    assert m["rollouts/total"] >= 32


class SlowEval(Environment):
    """reverse-text whose scoring takes `delay` seconds of (simulated) work: a long online eval."""

    def __init__(self, delay: float = 1.5):
        self.inner, self.delay = ReverseText(seed=99), delay
        self.num_examples = self.inner.num_examples

    def example(self, index: int) -> Example:
        return self.inner.example(index)

    async def score(self, example, messages, state) -> float:
        await asyncio.sleep(self.delay)  # simulated scorer latency, not synchronization
        return await self.inner.score(example, messages, state)


class SlowClient(FakeClient):
    async def generate(self, prompt_token_ids, **kw):
        await asyncio.sleep(0.1)  # simulated inference latency
        return await super().generate(prompt_token_ids, **kw)


def test_online_evals_interleave_with_training_instead_of_holding_up_the_step(tmp_path, tokenizer):
    delay = [1.5]  # the eval's scoring time, set from the plain steps' time below
    register_env("test-slow-eval", lambda **_: SlowEval(delay[0]))

    def steps(eval_interval: int) -> list[dict]:
        cfg = small_config(tmp_path / f"run{eval_interval}", batch_size=8, group_size=4)
        cfg.orchestrator.eval.update({"interval": eval_interval, "num_examples": 2, "group_size": 2})
        cfg.orchestrator.eval.envs = {"slow": _env("test-slow-eval")}
        client = SlowClient(tokenizer)
        orch = make_orchestrator(
            cfg, client=client, tokenizer=tokenizer, run_dir=tmp_path / f"run{eval_interval}"
        )
        return asyncio.run(orch.run(6))

    plain = steps(0)
    baseline = max(m["time/step_wall"] for m in plain)
    # The eval must outlast a plain step by a margin wherever this runs (a loaded CI box makes steps slower).
    delay[0] = max(1.5, 3 * baseline + 0.5)
    with_eval = steps(3)
    assert [m.get("eval/step") for m in with_eval][-1] == 6.0 and with_eval[-1]["eval/time"] >= delay[0]
    # Steps 4 and 5 run while the eval started after step 3 is still scoring: they take the time of a plain
    # step, not a plain step plus the eval's.
    for m in with_eval[3:5]:
        assert m["time/step_wall"] < baseline + 0.5 < delay[0]


def test_mixture_weights_set_each_envs_share_of_prompts(tmp_path, tokenizer):
    slots = [
        EnvSlot(name=n, env=ReverseText(), weight=w, algorithm=None) for n, w in (("a", 3.0), ("b", 1.0))
    ]
    buffer = Buffer(slots, seed=0)  # default settings: no pools, no filtering
    picks = [env for env, _ in buffer.sample(8000)]
    assert abs(picks.count("a") / len(picks) - 0.75) < 0.02
    # Through the orchestrator: rollouts per env over ten steps follow the same 3:1 split (4 sigma: +-0.07).
    cfg = small_config(tmp_path / "run", batch_size=64, group_size=1)  # 640 prompts in 10 steps
    cfg.orchestrator.envs = ConfigDict({"a": _env("reverse-text"), "b": _env("reverse-text", seed=1)})
    cfg.orchestrator.envs.a.weight, cfg.orchestrator.envs.b.weight = 3.0, 1.0
    cfg.orchestrator.filters.post_batch = ()
    cfg.orchestrator.async_level = 64  # no trainer here: never wait for weights
    orch = make_orchestrator(cfg, client=FakeClient(tokenizer), tokenizer=tokenizer, run_dir=tmp_path / "run")
    counts = {"a": 0, "b": 0}

    async def go():
        for step in range(1, 11):
            for r in (await orch.step(step)).rollouts:
                counts[r.env] += 1

    asyncio.run(go())
    share = counts["a"] / (counts["a"] + counts["b"])
    assert abs(share - 0.75) < 0.07, counts
