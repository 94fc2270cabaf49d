"""The step timeline and sample table the orchestrator writes beside its metrics (monitor.timeline,
monitor.samples_per_env), against an instant fake server: every request, wait, env call and phase lands on
its track, the trace is valid Chrome trace-event JSON, and a hostile env's megabyte reply is cut."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from orch_fakes import FakeClient, FakeClock, make_orchestrator, small_config

from primejax.config import typed
from primejax.envs.base import Environment, Example, Message
from primejax.envs.registry import register_env
from primejax.orchestrator.timeline import Timeline, chrome_trace
from primejax.utils.monitor import Monitor, read_jsonl


class TwoCalls(Environment):
    """Drives its own episode: a model call, its own work between calls, a second call."""

    drives_rollout = True
    max_turns = 4
    num_examples = 50

    def example(self, index: int) -> Example:
        return Example(key=f"two/{index}", prompt=[{"role": "user", "content": f"count {index}"}])

    async def rollout(self, example: Example, state: dict[str, Any], model: Any) -> list[Message]:
        messages = list(example.prompt)
        for turn in range(2):
            messages = [*messages, await model(messages), {"role": "user", "content": f"env says {turn}"}]
        return messages[:-1]

    async def score(self, example: Example, messages: list[Message], state: dict[str, Any]) -> float:
        return 1.0


def trace_spans(path) -> tuple[dict[tuple[int, int], str], list[dict]]:
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {
        (e["pid"], e["tid"]): f"{lanes[e['pid']]}/{e['args']['name']}"
        for e in events
        if e["name"] == "thread_name"
    }
    spans = [e for e in events if e["ph"] == "X"]
    assert all((e["pid"], e["tid"]) in threads and e["dur"] >= 0 for e in spans)
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)
    return threads, spans


def test_timeline_tracks_requests_waits_env_work_and_phases_and_samples_are_logged(tmp_path, tokenizer):
    register_env("test-two-calls", lambda: TwoCalls())
    cfg = small_config(
        tmp_path / "run", env_id="test-two-calls", batch_size=8, group_size=4, max_concurrent=1
    )
    cfg.orchestrator.pool.mode = "step"  # the per-step phases asserted below are the barrier's
    cfg.monitor.samples_per_env = 3
    cfg.monitor.timeline_image_every = 2
    c = typed(cfg)
    with Monitor(tmp_path / "run", "orchestrator") as monitor:
        # Each request yields to the loop (virtual time), so the other rollouts' requests queue for the slot.
        client = FakeClient(tokenizer, clock=FakeClock(), gen_time=0.1)
        orch = make_orchestrator(
            cfg,
            client=client,
            tokenizer=tokenizer,
            run_dir=tmp_path / "run",
            monitor=monitor,
            watch=c.monitor,
        )
        asyncio.run(orch.run(2))
    for step in (1, 2):
        threads, spans = trace_spans(tmp_path / "run" / "timeline" / f"step_{step}.json")
        by_track: dict[tuple[str, str], list[dict]] = {}
        for e in spans:
            by_track.setdefault((threads[(e["pid"], e["tid"])], e["name"]), []).append(e)
        assert [e["name"] for e in spans if e["cat"] == "phase"] == [
            "wait_for_weights",
            "generate",
            "postprocess",
            "gc",
        ]
        for g in (0, 1):  # two groups of 4: the shared first request, then each rollout's second call
            assert len(by_track[(f"groups/group {g}", "request")]) == 1
            assert by_track[(f"groups/group {g}", "request")][0]["args"]["n"] == 4
            for m in range(4):
                track = f"groups/group {g} · {m}"
                assert len(by_track[(track, "request")]) == 1 and len(by_track[(track, "score")]) == 1
                assert (
                    len(by_track[(track, "env")]) == 3
                )  # its own code before, between and after the model calls
        # One request slot: with 8 rollouts wanting their second call at once, most of them waited.
        assert len([e for e in spans if e["cat"] == "wait"]) >= 4
    samples = read_jsonl(tmp_path / "run" / "tables" / "orchestrator" / "rollout_samples.jsonl")
    assert [r["step"] for r in samples] == [1, 1, 1, 2, 2, 2]
    first = samples[0]
    assert first["prompt"] == "user: count " + str(first["example"]) and first["reward"] == 1.0
    assert first["completion"].count("assistant: ") == 2 and "user: env says 0" in first["completion"]
    assert first["turns"] == 2 and first["advantage"] == 0.0  # every reward equal: zero advantage
    assert [r["group"] for r in samples] == [0, 1, 0] * 2  # one per group before a second of the same group
    # Every second step's timeline is drawn as an image in TensorBoard (read with TensorBoard's own reader).
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "orchestrator")).Reload()
    images = events.Images("timeline")
    assert [i.step for i in images] == [2] and images[0].width > 500 and images[0].height > 200


def test_a_step_past_max_spans_drops_the_rest_and_says_so():
    t = [0.0]
    timeline = Timeline(clock=lambda: t[0], max_spans=3)
    for i in range(5):
        timeline.add("request", "request", i, i + 0.5, ("groups", f"group {i}"))
    spans, dropped = timeline.take()
    trace = chrome_trace(spans, timeline.origin, step=7, dropped=dropped)
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == 3
    assert trace["otherData"] == {"step": 7, "wall_clock_origin": 0.0, "dropped_spans": 2}
    assert timeline.take() == ([], 0)  # the next step starts empty


def test_tools_plot_draws_a_steps_timeline_and_refuses_a_missing_one(tmp_path, tokenizer):
    import subprocess
    import sys

    import matplotlib.image

    from primejax.orchestrator.timeline_plot import COLORS

    cfg = small_config(tmp_path / "run", batch_size=8, group_size=4)
    orch = make_orchestrator(
        cfg,
        client=FakeClient(tokenizer),
        tokenizer=tokenizer,
        run_dir=tmp_path / "run",
        watch=typed(cfg).monitor,
    )
    asyncio.run(orch.run(1))
    root = Path(__file__).resolve().parents[2]  # the tool runs from the checkout, as its users run it
    tool = [sys.executable, "-m", "tools.plot", str(tmp_path / "run"), "--timeline"]
    proc = subprocess.run(
        [*tool, "1", "--out", str(tmp_path / "t.png")], capture_output=True, text=True, cwd=root
    )
    assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path / "t.png"), proc.stderr[-2000:]
    png = matplotlib.image.imread(tmp_path / "t.png")[..., :3]
    phase = np.array([int(COLORS["phase"][i : i + 2], 16) / 255 for i in (1, 3, 5)])
    # The step's phases are drawn at alpha 0.9 over white: that color fills a visible part of the image.
    drawn = np.abs(png - (0.9 * phase + 0.1)).max(axis=-1) < 0.02
    assert drawn.mean() > 0.01
    proc = subprocess.run([*tool, "9"], capture_output=True, text=True, cwd=root)
    assert (
        proc.returncode == 2 and proc.stderr.strip().startswith("error: no ") and "step_9.json" in proc.stderr
    )


def test_continuous_pool_each_request_lands_in_exactly_one_steps_trace(tmp_path, tokenizer):
    """In continuous mode groups outlive the step that dispatched them: a span is written by the first step
    ending after it ended, so the step files together hold every request once."""
    cfg = small_config(tmp_path / "run", batch_size=8, group_size=4)
    cfg.orchestrator.pool.mode = "continuous"
    client = FakeClient(tokenizer, clock=FakeClock(), gen_time=0.1)
    orch = make_orchestrator(
        cfg, client=client, tokenizer=tokenizer, run_dir=tmp_path / "run", watch=typed(cfg).monitor
    )
    asyncio.run(orch.run(3))
    requests = 0
    for step in (1, 2, 3):
        _, spans = trace_spans(tmp_path / "run" / "timeline" / f"step_{step}.json")
        assert [e["name"] for e in spans if e["cat"] == "phase"] == ["batch_cut", "postprocess", "gc"]
        requests += sum(e["cat"] == "request" for e in spans)
    # Requests still running when the run stopped were cancelled after the last step's file: still in the timeline.
    left, _ = orch.watch.timeline.take()
    cancelled = [s for s in left if s.cat == "request"]
    assert requests >= 6 and requests + len(cancelled) == len(client.requests)
    assert all(s.name == "request (failed)" for s in cancelled)
