"""One owner of the run directory's layout: `primejax.contracts.rundir` names every path, spells and parses `step_N`."""

from __future__ import annotations

import re
from pathlib import Path

from primejax.contracts.rundir import RunDir, parse_step, step_dirs, step_name

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "primejax" / "contracts" / "rundir.py"
# Spellings of the layout that only the owner may write.
SPELLINGS = re.compile(
    r"""f["']step_\{|step_\(\\d|["'](rollouts|broadcasts|checkpoints)["']|["']sft["']\s*/\s*["']final"""
)


def test_step_names_round_trip_and_temp_entries_never_match(tmp_path):
    assert (
        step_name(12) == "step_12"
        and parse_step("step_12") == 12
        and parse_step("/a/broadcasts/step_3/") == 3
    )
    for other in ("step_", "step_1a", ".step_4.abc.tmp", "xstep_2", "/a/hf"):
        assert parse_step(other) is None, other
    for name in ("step_10", "step_2", ".step_3.x.tmp", "notes"):
        (tmp_path / name).mkdir()
    assert [(n, p.name) for n, p in step_dirs(tmp_path)] == [(2, "step_2"), (10, "step_10")]
    assert step_dirs(tmp_path / "missing") == []


def test_the_layout(tmp_path):
    run = RunDir(tmp_path)
    assert run.rollouts(3) == tmp_path / "rollouts" / "step_3" and run.broadcasts() == tmp_path / "broadcasts"
    assert run.checkpoints(2, "trainer") == tmp_path / "checkpoints" / "step_2" / "trainer"
    assert run.config("trainer") == tmp_path / "configs" / "trainer.json"
    assert run.sft_final == tmp_path / "sft" / "final" and run.pids_file.name == "pids.json"
    assert run.metrics("orchestrator") == tmp_path / "metrics" / "orchestrator.jsonl"
    assert run.run_info("sft") == tmp_path / "metrics" / "sft.run.json" and run.wandb == tmp_path / "wandb"
    assert run.timeline(4) == tmp_path / "timeline" / "step_4.json"
    assert (
        run.table("orchestrator", "eval/samples")
        == tmp_path / "tables" / "orchestrator" / "eval.samples.jsonl"
    )
    assert (
        run.table("orchestrator", "../x") == tmp_path / "tables" / "orchestrator" / "...x.jsonl"
    )  # stays inside


def test_no_other_module_spells_the_layout():
    offenders = []
    for path in sorted((ROOT / "primejax").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py")):
        if path == OWNER:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if SPELLINGS.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
