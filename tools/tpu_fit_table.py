"""The TPU fit table of docs/benchmarks.md: `tools.tpu_compile --recommend` over models x tokens x slices.

    python -m tools.tpu_fit_table --out DIR [--jobs 2] [--models qwen3-0.6b,qwen3-4b,qwen3-8b]
        [--tokens 16384,65536] [--topologies v5e-16,v6e-8,v5p-16] [--config configs/tpu.py]

Each cell is one `python -m tools.tpu_compile --recommend` process (rows of `tokens` tokens, one row per
chip under FSDP) writing DIR/<model>_<tokens>_<topology>.json; cells already in DIR are not recompiled.
Ends with the markdown table. Compile-time figures, not measured speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GIB = 2**30


def _cell(out: Path, config: str, model: str, tokens: int, topology: str) -> Path:
    path = out / f"{model}_{tokens}_{topology}.json"
    if path.is_file():
        return path
    cmd = [
        sys.executable,
        "-m",
        "tools.tpu_compile",
        "--config",
        config,
        "--model",
        model,
        "--topology",
        topology,
        "--seq_len",
        str(tokens),
        "--tokens_per_chip",
        str(tokens),
        "--recommend",
        "--tensor_sizes=1,2",
        "--json",
        str(path),
    ]
    log = path.with_suffix(".log")
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        print(
            f"{model} {tokens} {topology}: tools.tpu_compile exited {proc.returncode}, see {log}",
            file=sys.stderr,
        )
    return path


def _row(path: Path) -> str:
    if not path.is_file():
        return f"| {path.stem.replace('_', ' | ')} | failed: see {path.with_suffix('.log').name} | | | | |"
    data = json.loads(path.read_text())
    reports, best = data["reports"], data["recommended"]
    r0 = reports[0]
    head = (
        f"| {r0['model']} | {r0['tokens_per_device'] / 1024:.0f}k | {r0['topology']} ({r0['chips']} chips, "
        f"{r0['hbm_bytes'] / GIB:.0f} GiB) |"
    )
    tried = ", ".join(
        f"{_mesh(r)}/{r['remat_setting']}: {'OOM ' if r['out_of_memory'] else ''}{r['peak_bytes'] / GIB:.1f}"
        for r in reports
    )
    if best is None:
        return f"{head} does not fit | | | {tried} |"
    return (
        f"{head} {_mesh(best)}, {best['remat_setting']} | {best['peak_bytes'] / GIB:.1f} "
        f"(args {best['argument_bytes'] / GIB:.1f}, temps {best['temp_bytes'] / GIB:.1f}) | "
        f"{best['flops'] / 1e12:.0f} | {tried} |"
    )


def _mesh(r: dict) -> str:
    return "x".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1) or "1"


HEADER = (
    "| model | tokens/chip | slice | recommended mesh, remat | per-chip GiB | TFLOP/chip/step | "
    "tried (mesh/remat: GiB) |\n|---|---|---|---|---|---|---|"
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-4b,qwen3-8b")
    p.add_argument("--tokens", default="16384,65536")
    p.add_argument("--topologies", default="v5e-16,v6e-8,v5p-16")
    p.add_argument("--config", default="configs/tpu.py")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [
        (m, int(t), topo)
        for m in a.models.split(",")
        for t in a.tokens.split(",")
        for topo in a.topologies.split(",")
    ]
    with ThreadPoolExecutor(a.jobs) as pool:
        paths = list(pool.map(lambda c: _cell(out, a.config, *c), cells))
    print(HEADER)
    for path in paths:
        print(_row(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
