"""What the orchestrator logs beside its step metrics, for a person watching the run (the `monitor` section):
the inference servers' own metrics (primejax.orchestrator.server_stats), the step's timeline
(primejax.orchestrator.timeline) and a few sample rollouts per env (prompt, completion, reward, advantage).
docs/monitoring.md shows where each lands.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
from pathlib import Path
from typing import Any

from primejax.contracts.rundir import RunDir
from primejax.orchestrator.rollout import Rollout
from primejax.orchestrator.server_stats import ServerStats
from primejax.orchestrator.timeline import Timeline, chrome_trace
from primejax.orchestrator.timeline_plot import available as can_draw
from primejax.orchestrator.timeline_plot import to_image
from primejax.utils.io import atomic_write_text
from primejax.utils.monitor import MonitorConfig

log = logging.getLogger(__name__)

SAMPLE_COLUMNS = (
    "env",
    "example",
    "group",
    "reward",
    "advantage",
    "reward_components",
    "turns",
    "completion_tokens",
    "policy_version",
    "prompt",
    "completion",
)
STEP_TRACK = ("step", "orchestrator")
WEIGHTS_TRACK = ("weights", "orchestrator")


def _message_text(message: dict[str, Any]) -> str:
    text = (
        f"{message.get('role', '?')}: {message.get('content') if message.get('content') is not None else ''}"
    )
    if message.get("tool_calls"):
        text += f"\n  tool_calls: {json.dumps(message['tool_calls'], default=str)}"
    return text


def sample_rows(rollouts: list[Rollout], shipped: list[Rollout], per_env: int, chars: int) -> list[list[Any]]:
    """Up to `per_env` rollouts of each env, those shipped to the trainer first and one per group before a
    second of the same group (different prompts say more), as rows of SAMPLE_COLUMNS. The prompt keeps its
    last `chars` characters (the newest turn), the completion its first `chars`."""
    if per_env <= 0:
        return []
    ids = {id(r) for r in shipped}
    candidates = shipped + [r for r in rollouts if r.ok and id(r) not in ids]
    firsts: dict[tuple[str, int], Rollout] = {}
    for r in candidates:
        firsts.setdefault((r.env, r.group_id), r)
    chosen = {id(r) for r in firsts.values()}
    ordered = list(firsts.values()) + [r for r in candidates if id(r) not in chosen]
    rows, taken = [], {}
    for r in ordered:
        if taken.get(r.env, 0) >= per_env:
            continue
        taken[r.env] = taken.get(r.env, 0) + 1
        n_prompt = len(r.example.prompt)
        prompt = "\n".join(_message_text(m) for m in r.messages[:n_prompt])
        completion = "\n".join(_message_text(m) for m in r.messages[n_prompt:])
        components = {str(k): v for k, v in (r.state.get("reward_components") or {}).items()}
        rows.append(
            [
                r.env,
                r.example_index,
                r.group_id,
                float(r.reward) if r.reward is not None else float("nan"),
                statistics.fmean(r.advantages) if r.advantages else float("nan"),
                json.dumps(components, default=str)[:chars],
                r.num_turns,
                r.num_completion_tokens,
                r.min_policy_version,
                prompt if len(prompt) <= chars else "..." + prompt[-chars:],
                completion if len(completion) <= chars else completion[:chars] + "...",
            ]
        )
    return rows


class RunWatch:
    def __init__(self, cfg: MonitorConfig, run_dir: str | Path, client: Any, tracker: Any, generator: Any):
        """`client`: the policy's client (its `metrics_text()` reads the servers' pages; a stand-in without
        one gets no server metrics); `tracker`: the policy tracker, whose weight updates are drawn;
        `generator`: the group generator, which records its requests and env calls on the timeline."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.client, self.tracker = client, tracker
        self.timeline = Timeline() if cfg.timeline else None
        generator.timeline = self.timeline
        self.image_every = cfg.timeline_image_every if cfg.timeline and can_draw() else 0
        if cfg.timeline and cfg.timeline_image_every and not self.image_every:
            log.info(
                "monitor.timeline_image_every: matplotlib is not installed, no timeline images are logged"
            )
        read = getattr(client, "metrics_text", None)
        self.servers = ServerStats(read, poll_s=cfg.server_poll_s) if cfg.server_metrics and read else None

    async def start(self) -> list[asyncio.Task]:
        """Take the servers' first reading (the first step's rates start there); the background poller."""
        if self.servers is None:
            return []
        await self.servers.take()
        return [asyncio.create_task(self.servers.run())]

    def phases(self, parts: list[tuple[str, float]]) -> None:
        """The step's phases (name, seconds), back to back and ending now, on the timeline's step track."""
        if self.timeline is None:
            return
        end = self.timeline.clock()
        for name, seconds in reversed(parts):
            self.timeline.add("phase", name, end - seconds, end, STEP_TRACK)
            end -= seconds

    def _weight_updates(self) -> None:
        events = getattr(self.tracker, "update_events", None)
        index = {url: i for i, url in enumerate(getattr(self.client, "base_urls", ()))}
        while events:
            u = events.popleft()
            loads = {index[url]: s for url, s in u.load_seconds.items() if url in index}
            if self.servers is not None:
                self.servers.weight_loads(loads)
            if self.timeline is not None:
                self.timeline.add(
                    "weights",
                    f"update to v{u.step}",
                    u.start,
                    u.end,
                    WEIGHTS_TRACK,
                    transport=u.transport,
                    version=u.step,
                )
                for i, seconds in loads.items():  # each server's own load, ending when the update ended
                    self.timeline.add(
                        "weights",
                        f"load v{u.step}",
                        max(u.start, u.end - seconds),
                        u.end,
                        ("weights", f"server {i}"),
                        load_seconds=seconds,
                    )

    async def step_metrics(self) -> dict[str, float]:
        """The servers' metrics of the step that just ended (server/*); {} when they are not logged."""
        self._weight_updates()
        return await self.servers.take() if self.servers is not None else {}

    @staticmethod
    def _write_trace(path: Path, trace: dict[str, Any], step: int) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(trace, separators=(",", ":"), default=str))
        except OSError as e:  # a full disk loses the trace, not the run
            log.warning("step %d: writing the timeline failed: %s", step, e)

    async def log(self, monitor: Any, step: int, rollouts: list[Rollout], shipped: list[Rollout]) -> None:
        """Write the step's timeline file (and every `image_every` steps its image) and its sample table, after
        the step's metrics were logged."""
        if self.timeline is not None:
            spans, dropped = self.timeline.take()
            trace = chrome_trace(
                spans, self.timeline.origin, step=step, wall_origin=self.timeline.wall_origin, dropped=dropped
            )
            # Serialized and written (fsync) off the event loop: requests in flight go on meanwhile.
            await asyncio.to_thread(self._write_trace, RunDir(self.run_dir).timeline(step), trace, step)
            if monitor is not None and spans and self.image_every and step % self.image_every == 0:
                # Drawn off the event loop too (2 s of CPU for the demo's 256 rollouts on a loaded 2-core box).
                title = f"{self.run_dir.name}: step {step} timeline"
                monitor.image(step, "timeline", await asyncio.to_thread(to_image, trace, title))
        rows = sample_rows(rollouts, shipped, self.cfg.samples_per_env, self.cfg.sample_chars)
        if monitor is not None and rows:
            monitor.table(step, "rollout_samples", SAMPLE_COLUMNS, rows)
