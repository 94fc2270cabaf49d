"""tools/compare_corrections.py's table: a run without trainer steps is no row of NaNs, a short run is marked."""

from __future__ import annotations

import math

from tools.compare_corrections import table


def _rows(n: int, reward: float, grad_norm: float = 0.5) -> list[dict]:
    return [
        {
            "step": s,
            "reward": reward,
            "mismatch_kl": 1e-3,
            "masked_frac": 0.01,
            "rejected_frac": 0.0,
            "seq_masked_frac": 0.0,
            "is_weight_mean": 1.0,
            "is_weight_max": 2.0,
            "grad_norm": grad_norm,
        }
        for s in range(1, n + 1)
    ]


def test_a_run_still_starting_is_listed_not_tabled_and_a_short_run_is_marked():
    # gspo: its trainer.jsonl exists but holds no step yet (the report that showed gspo as NaN was made then)
    md = table(
        {"dppo": _rows(30, 0.8), "gspo": [], "cispo": _rows(12, 0.7)}, {"dppo": 600.0, "gspo": 680.0}, 30
    )
    lines = md.splitlines()
    assert not any(line.startswith("| gspo") for line in lines)
    assert "nan" not in md
    assert lines[-1].startswith("No trainer step yet") and lines[-1].endswith(": gspo")
    (cispo,) = [line for line in lines if line.startswith("| cispo")]
    assert cispo.startswith("| cispo (steps 1-12 of 30) | 0.700 | 0.700 | -0.100 |") and "| n/a |" in cispo
    (dppo,) = [line for line in lines if line.startswith("| dppo")]
    assert "| +0.000 |" in dppo and dppo.endswith("| 0.50 | 600s |")


def test_a_nan_the_run_logged_shows_as_nan():
    rows = _rows(30, 0.8)
    rows[3]["grad_norm"] = math.nan  # max() over [0.5, nan, 0.5] would have dropped it
    md = table({"dppo": _rows(30, 0.8), "gspo": rows}, {}, 30)
    (gspo,) = [line for line in md.splitlines() if line.startswith("| gspo")]
    assert gspo.split("|")[-3].strip() == "nan"
