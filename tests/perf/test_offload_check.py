"""tools/bench_offload_check.py, the GPU row that compares the offloaded update with the on-device one, runs its
smoke row on 4 emulated CPU devices: fp32 parameters with the moments in host memory match the reference to an
ulp, the two bf16-copy placements match each other exactly, and the check reports ok."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_offload_check_smoke_row(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_moe.py"), "--suite", "smoke:offload", "--only",
         "tiny:offload_check", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((tmp_path / "bench_moe.jsonl").read_text().splitlines()[-1])
    assert not r.get("error"), r.get("error")
    cases = r["cases"]
    assert cases["moments"]["buckets"] > 1 and cases["master"]["buckets"] > 1
    assert max(cases["moments"][f"{k}_rel"] for k in ("master", "mu", "nu")) <= 1e-6, cases["moments"]
    assert cases["master_on_gpu"]["vs_master_rel"] == 0.0, cases["master_on_gpu"]
    assert r["ok"], cases
