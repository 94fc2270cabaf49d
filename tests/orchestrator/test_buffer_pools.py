"""Difficulty pools (moving examples, metrics, persistence across checkpoint/resume, lifting on resume) and
online difficulty filtering (exactly the all-0 and all-1 groups, topped-up batches)."""

from __future__ import annotations

import asyncio
import json

import pytest
from orch_fakes import FakeClient, make_orchestrator, small_config

from primejax.contracts.rundir import checkpoint_dir
from primejax.envs.base import Environment, Example
from primejax.envs.registry import register_env
from primejax.envs.reverse_text import ReverseText
from primejax.orchestrator.buffer import Buffer, BufferSettings, EnvSlot
from primejax.orchestrator.checkpoint import load_checkpoint
from primejax.orchestrator.loop import Orchestrator


def buffer(n: int = 10, **settings) -> Buffer:
    return Buffer(
        [EnvSlot("rt", ReverseText(num_examples=n), 1.0, None)], seed=0, settings=BufferSettings(**settings)
    )


def test_pools_retire_examples_at_their_thresholds_and_report_ratios():
    b = buffer(easy_threshold=0.9, hard_threshold=0.1)
    assert b.observe_group("rt", 3, [1.0, 0.8])  # mean 0.9: at the easy threshold
    assert b.observe_group("rt", 4, [0.0, 0.2])  # mean 0.1: at the hard threshold
    assert b.observe_group("rt", 5, [0.5, 0.89])  # normal
    assert b.observe_group("rt", 6, [0.11, 0.11])  # just above hard: normal
    assert b.pools["easy"]["rt"] == {3} and b.pools["hard"]["rt"] == {4}
    assert {i for _, i in b.sample(500)} == set(range(10)) - {3, 4}
    m = b.step_metrics()
    assert m["pool/rt/easy"] == 0.1 and m["pool/rt/hard"] == 0.1 and m["pool/rt/normal"] == 0.8
    assert m["evicted_examples/rt/easy"] == 0.25 and m["evicted_examples/rt/hard"] == 0.25
    assert b.step_metrics()["evicted_examples/rt/easy"] == 0.0  # per step


def test_pools_are_off_without_thresholds_and_an_exhausted_env_fails_loudly():
    b = buffer(n=2)
    assert b.observe_group("rt", 0, [1.0]) and b.observe_group("rt", 1, [0.0])
    assert b.pools["easy"]["rt"] == set() and b.pools["hard"]["rt"] == set()
    b = buffer(n=2, easy_threshold=1.0)
    b.observe_group("rt", 0, [1.0])
    b.observe_group("rt", 1, [1.0])
    with pytest.raises(RuntimeError, match="no example left"):
        b.sample(1)


def test_lift_moves_the_configured_fraction_back_into_rotation():
    b = buffer(n=100, easy_threshold=1.0, hard_threshold=0.0, easy_fraction=0.5, hard_fraction=0.0)
    for i in range(10):
        b.observe_group("rt", i, [1.0])
        b.observe_group("rt", 50 + i, [0.0])
    assert b.lift() == {"rt/easy": 5, "rt/hard": 0}
    assert len(b.pools["easy"]["rt"]) == 5 and len(b.pools["hard"]["rt"]) == 10


def test_online_difficulty_filtering_drops_exactly_the_all_zero_and_all_one_groups():
    b = buffer(online_difficulty_filtering=True)
    assert not b.observe_group("rt", 0, [0.0, 0.0, 0.0])
    assert not b.observe_group("rt", 1, [1.0, 1.0])
    assert b.observe_group("rt", 2, [0.0, 1.0])
    assert b.observe_group("rt", 3, [1e-9, 0.0])
    assert b.observe_group("rt", 4, [1.0, 1.0 - 1e-9])
    assert b.observe_group("rt", 5, [0.5, 0.5])
    assert b.observe_group("rt", 6, [])  # all errored: nothing to drop
    m = b.step_metrics()
    assert m["filtered_rollouts/rt/hard"] == 3 and m["filtered_rollouts/rt/easy"] == 2
    assert buffer().observe_group("rt", 0, [0.0, 0.0])  # off by default


def run(cfg, tokenizer, steps: int) -> tuple[Orchestrator, list[dict[str, float]]]:
    orch = make_orchestrator(
        cfg,
        client=FakeClient(tokenizer),
        tokenizer=tokenizer,
        run_dir=cfg.run.output_dir + "/" + cfg.run.name,
    )
    orch.resume(cfg.run.resume_step)
    return orch, asyncio.run(orch.run(steps))


def test_pools_persist_as_jsonl_in_the_checkpoint_and_fractions_lift_on_resume(tmp_path, tokenizer):
    # FakeClient: member i drops i characters, so groups of 2 on 3-6 letter texts have a mean reward in (0.8, 1).
    cfg = small_config(tmp_path / "run", batch_size=8, group_size=2)
    cfg.orchestrator.envs.reverse_text.args.num_examples = 40
    cfg.orchestrator.buffer.update({"easy_threshold": 0.9, "hard_threshold": 0.1})
    cfg.orchestrator.checkpoint.update({"interval": 1, "keep": 2})
    orch, history = run(cfg, tokenizer, 2)
    easy = orch.buffer.pools["easy"]["reverse_text"]
    assert easy and history[-1]["pool/reverse_text/easy"] == len(easy) / 40
    ckpt = checkpoint_dir(tmp_path / "run", 2, "orchestrator")
    lines = [json.loads(x) for x in (ckpt / "easy_examples.jsonl").read_text().splitlines()]
    assert {r["index"] for r in lines} == easy and all(r["key"].startswith("reverse-text/") for r in lines)
    assert (ckpt / "hard_examples.jsonl").read_text() == ""
    assert "pools" not in load_checkpoint(tmp_path / "run", "2")["buffer"]

    cfg.run.resume_step = "2"
    resumed, _ = run(cfg, tokenizer, 2)  # nothing left to run: state only
    assert resumed.buffer.pools["easy"]["reverse_text"] == easy
    cfg.orchestrator.buffer.easy_fraction = 1.0
    lifted, _ = run(cfg, tokenizer, 2)
    assert lifted.buffer.pools["easy"]["reverse_text"] == set()


class HalfSolved(Environment):
    """Even examples are always solved (reward 1), odd ones score like reverse-text (member-dependent)."""

    def __init__(self):
        self.inner = ReverseText(min_len=6, max_len=6)
        self.num_examples = 1000

    def example(self, index: int) -> Example:
        ex = self.inner.example(index)
        return Example(ex.key, ex.prompt, ex.answer, {"index": index})

    async def score(self, example, messages, state) -> float:
        if example.info["index"] % 2 == 0:
            return 1.0
        return await self.inner.score(example, messages, state)


@pytest.mark.parametrize("mode", ["continuous", "step"])
def test_odf_with_oversampling_keeps_the_batch_full(tmp_path, tokenizer, mode):
    register_env("test-half-solved", lambda: HalfSolved())
    cfg = small_config(tmp_path / "run", env_id="test-half-solved", batch_size=8, group_size=4)
    cfg.orchestrator.buffer.update({"online_difficulty_filtering": True, "oversampling_factor": 1.5})
    cfg.orchestrator.pool.mode = mode
    _, (m,) = run(cfg, tokenizer, 1)
    assert m["batch/rollouts"] == 8
    assert m["filtered_rollouts/reverse_text/easy"] > 0 and m["filtered_rollouts/reverse_text/easy"] % 4 == 0
    if mode == "step":
        # the barrier's top-up rounds: every generated rollout is in the distributions, shipped or dropped (the
        # pool drops a retiring group as it finishes, before any cut counts it)
        assert m["rollouts/total"] >= 8 + m["filtered_rollouts/reverse_text/easy"]
