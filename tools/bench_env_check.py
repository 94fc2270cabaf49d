"""How fast `python -m primejax.train --dry_run` catches a broken environment (docs/benchmarks.md).

Runs the dry run `--repeats` times on a config with a taskset whose import fails, one whose loading raises
(tests/envs/vf_broken_taskset.py, vf_raising_taskset.py) and the default healthy builtin env, and prints per
run: seconds to the first `error:` line, seconds to exit, the child's CPU seconds and the 1-minute load
average (the CPU machines are shared: wall time under load says little without it).

    PYTHONPATH=$PWD python -m tools.bench_env_check --repeats 3
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """from primejax.config import default_config, env


def get_config():
    c = default_config()
    c.run.output_dir = {out!r}
    c.model.path = {model!r}
    c.orchestrator.envs.broken = env("tests.envs.vf_broken_taskset")
    c.orchestrator.envs.raising = env("tests.envs.vf_raising_taskset")
    return c
"""


def one_run(config: Path) -> tuple[float, float, float, int]:
    """(seconds to the first error line, seconds to exit, child CPU seconds, exit status)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "primejax.train", "--config", str(config), "--dry_run"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    first_error = float("nan")
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("error: env ") and first_error != first_error:
            first_error = time.perf_counter() - start
    code = proc.wait()
    total = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return first_error, total, cpu, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        from primejax.models.tiny import build_tiny_model

        model = build_tiny_model(Path(tmp) / "model", tied=True, seed=0)
        config = Path(tmp) / "broken.py"
        config.write_text(CONFIG.format(out=str(Path(tmp) / "runs"), model=str(model)))
        print("run  first error (s)  exit (s)  CPU (s)  load 1m  exit status")
        for i in range(args.repeats):
            load = os.getloadavg()[0]
            first, total, cpu, code = one_run(config)
            print(f"{i + 1:>3}  {first:>15.1f}  {total:>8.1f}  {cpu:>7.1f}  {load:>7.2f}  {code}")


if __name__ == "__main__":
    main()
