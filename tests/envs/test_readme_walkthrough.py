"""The README's walkthrough (install to a tool-using verifiers run) runs as written: its commands, in a scratch
directory, with fewer steps (2 SFT steps, 3 RL steps, small batches). The install line is what CI ran already.

Its run is also CI's end-to-end check of the main command (issue 8; the same checks on `configs/debug.py` are
tests/e2e/test_train_short.py, extended tier): exit 0, every step's batch trained once, the server moved to the
broadcasts the off-policy bound required, trainer/vLLM mismatch KL on the first step <= 1e-3 (fp32 on both
sides), and no process of the run left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from procs import processes_mentioning
from wandb_files import wandb_history

from primejax.utils.monitor import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
# SFT, a vLLM server start and one RL step in one test: minutes, far more on a machine shared with other jobs.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]
STEPS = 3
SHORTER = [
    f"--config.run.max_steps={STEPS}",
    "--config.orchestrator.batch_size=8",
    "--config.orchestrator.group_size=4",
    "--config.sft.batch_size=4",
    "--config.inference.port=0",
    "--config.inference.startup_timeout_s=900",  # a loaded 2-core machine took over 300 s to start the server
    "--config.monitor.wandb=True",  # every sink of every process (W&B offline: no network)
]


def walkthrough() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Walkthrough: from install to a tool-using verifiers run") :]
    return re.search(r"```bash\n(.*?)\n```", section, re.DOTALL).group(1)


def test_the_readme_walkthrough_runs(tmp_path):
    script = walkthrough()
    assert script.startswith("bash tools/install.sh\n")
    script = script.removeprefix("bash tools/install.sh\n").replace(
        "--config.sft.steps=40", "--config.sft.steps=2"
    )
    lines = script.splitlines()
    last = max(i for i, line in enumerate(lines) if "primejax.train" in line)
    lines[last] += " " + " ".join(SHORTER)
    for name in (".venv", "configs"):  # the commands are relative to the repository root
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "outputs").mkdir()
    proc = subprocess.run(
        ["bash", "-e", "-c", "\n".join(lines)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=2300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    demos = [
        json.loads(line) for line in (tmp_path / "outputs" / "tool_demos.jsonl").read_text().splitlines()
    ]
    assert len(demos) == 64 and all(d["messages"][-3]["tool_calls"] and d["tools"] for d in demos)
    run = tmp_path / "outputs" / "verifiers-tools"
    assert (run / "sft" / "final" / "config.json").exists()
    orch = read_jsonl(run / "metrics" / "orchestrator.jsonl")
    assert [r["step"] for r in orch] == list(range(1, STEPS + 1))
    assert all(r["rollouts/errored"] == 0 and "tools/well_formed_fraction" in r for r in orch)
    # Every step trained once, on exactly the samples the orchestrator wrote for it.
    trainer = read_jsonl(run / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in trainer] == list(range(1, STEPS + 1))
    assert {r["step"]: r["batch/num_samples"] for r in trainer} == {
        r["step"]: r["samples/count"] for r in orch
    }
    # The server followed the broadcasts: versions only move forward, and every step sampled within the bound.
    served = [
        int(v)
        for v in re.findall(
            r"now serves policy version (\d+)", (run / "logs" / "orchestrator.log").read_text()
        )
    ]
    k = json.loads((run / "configs" / "orchestrator.json").read_text())["orchestrator"]["async_level"]
    assert served and served == sorted(set(served)) and served[-1] >= STEPS - 1 - k, served
    # (a step whose groups all had zero advantage trains on nothing and has no sample version to check)
    assert all(r["step"] - 1 - r["policy/min_version"] <= k for r in orch if r["samples/count"]), orch
    assert 0.0 <= trainer[0]["mismatch_kl"] <= 1e-3, trainer[0]["mismatch_kl"]
    assert processes_mentioning(str(run)) == []
    # Every sink: each process's W&B offline run holds every metric of its JSONL, at the same step and value.
    for process in ("sft", "trainer", "orchestrator"):
        logged = wandb_history(run, process)
        for row in read_jsonl(run / "metrics" / f"{process}.jsonl"):
            for key, value in row.items():
                if key not in ("step", "time") and value is not None:
                    assert float(json.loads(logged[row["step"]][key])) == pytest.approx(value, rel=1e-6), key
        assert (run / "tensorboard" / process).is_dir() and (run / "metrics" / f"{process}.run.json").exists()
    assert all("server/0/gen_tokens_per_s" in r for r in orch)
    samples = read_jsonl(run / "tables" / "orchestrator" / "rollout_samples.jsonl")
    assert {r["step"] for r in samples} == set(range(1, STEPS + 1))
    # The tool env's own work between model calls is on the timeline. Not in every step's file: a step's file holds
    # the spans that ended since the last one, and the continuous pool may have made all of a step's rollouts in
    # the window before (under load a step's file once held only a score span).
    traces = [json.loads((run / "timeline" / f"step_{s}.json").read_text()) for s in range(1, STEPS + 1)]
    assert any(
        e.get("cat") == "env" and e["name"] in ("env", "tool") for t in traces for e in t["traceEvents"]
    )
