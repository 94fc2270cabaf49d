"""Compile the trainer's real step for a TPU slice on a host without a TPU, and report per-chip memory and FLOPs.

    python -m tools.tpu_compile --config configs/x.py --topology v5p-16 [--model qwen3-8b] [--seq_len 65536]
        [--tokens_per_chip 65536] [--recommend] [--json OUT] [--config.KEY=VALUE ...]

The step is the one `python -m primejax.trainer` runs (primejax/trainer/aot.py): model, loss, optimizer,
remat policy, attention kernel ("auto" = splash on TPU) and mesh from the config, compiled ahead of time
from abstract inputs for the slice's devices. `--model` swaps in the shape of a known checkpoint (HF
config.json values; no weights needed). `--recommend` compiles remat policies in order of recompute (least
FLOPs first) on each mesh in turn — FSDP alone, or, for rows longer than the tokens per chip, a
context-parallel split of each row; then the tensor-parallel meshes (with context where the row still needs
it) — at the same tokens per chip, and stops at the first plan that fits the chip's HBM: the fewest compiled
FLOPs per chip among the plans that fit.

Rows longer than the tokens per chip (`--tokens_per_chip` < `--seq_len`) must be split over chips: a row of
T tokens over C = context chips leaves T / C tokens per chip. Context parallelism (models/context_parallel.py)
splits every per-token activation that way and re-splits only attention by heads (one all-to-all each for q,
k, v and the output), so at a fixed number of tokens per chip it is what shrinks the activations that decide
the fit; tensor parallelism replicates a tensor group's rows (the residual stream, norms, saved layer inputs)
on each of its chips and adds two all-reduces per layer, so it comes after. Only the smallest context size
that gives the tokens per chip is tried with each tensor size: a larger one holds the same tokens, weight
shards and attention heads per chip (its context group takes more rows). When rows fit one per chip
(`--tokens_per_chip` >= `--seq_len`, the default), that is context 1: splitting a row that fits buys no
memory at the same tokens per chip and adds the all-to-alls.

These are compile-time figures (XLA's memory plan and FLOP count for the TPU target), not measured speed.
Needs libtpu: `tools/install.sh` puts it in `<venv>/tpu-aot` (see primejax/trainer/tpu_topology.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from absl import flags

from primejax.config.cli import UsageError, parse_config, run_main
from primejax.launcher.preflight import preflight_tool
from primejax.trainer.hlo_collectives import collective_bytes
from primejax.trainer.tpu_topology import GIB, parse_slice, topology_devices, use_libtpu
from tools.model_shapes import QWEN3

# The tool's own flags beside --config (a table: one flag a line).
# fmt: off
FLAGS = (
    (flags.DEFINE_string, "topology", None, "TPU slice: v5p-16, v5e-16, v6e-8, or libtpu's v5e:4x4"),
    (flags.DEFINE_string, "model", "", f"a known shape instead of model.path: {', '.join(QWEN3)}"),
    (flags.DEFINE_integer, "seq_len", 0, "tokens per packed row (0 = trainer.fake_data.seq_len)"),
    (flags.DEFINE_integer, "tokens_per_chip", 0, "tokens per chip per micro-batch; sets the micro-batch rows "
                                                 "(0 = trainer.micro_batch_size rows per data-parallel rank)"),
    (flags.DEFINE_integer, "micro_batches", 1, "micro-batches per step (gradient accumulation)"),
    (flags.DEFINE_integer, "max_segments", 0, "static bound on samples per row (0 = unknown)"),
    (flags.DEFINE_bool, "recommend", False, "try meshes x remat policies and pick one"),
    (flags.DEFINE_string, "json", "", "also write the report(s) to this JSON file"),
    (flags.DEFINE_string, "tensor_sizes", "1,2,4,8", "--recommend: tensor-parallel sizes to try, in order"),
    (flags.DEFINE_string, "context_sizes", "1,2,4,8,16", "--recommend: context-parallel sizes to try (a row of "
                                                         "seq_len tokens over C chips), in order"),
)
# fmt: on


def _flags(fv: flags.FlagValues) -> None:
    for define, name, default, doc in FLAGS:
        define(name, default, doc, flag_values=fv)


def _model_config(cfg, name: str):
    from primejax.models.config import ModelConfig
    from primejax.trainer.engine import model_config

    if not name:
        return model_config(cfg.model, max_positions=cfg.trainer.fake_data.seq_len)
    if name not in QWEN3:
        raise UsageError(f"--model {name!r}: one of {', '.join(QWEN3)}")
    return ModelConfig.from_hf_config(QWEN3[name], **cfg.model.overrides())


def _line(r: dict[str, Any], hbm: int) -> str:
    g = lambda b: f"{b / GIB:7.2f}"  # noqa: E731
    mesh = "x".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1) or "1"
    fits = "OOM" if r["out_of_memory"] else "yes" if r["fits"] else "NO"
    flops = f"{r['flops'] / 1e12:9.2f}" if not r["out_of_memory"] else f"{'-':>9}"
    return (
        f"{mesh:>16} {r['remat_policy']:>19} {r['tokens_per_device']:>8.0f} {g(r['argument_bytes'])} "
        f"{g(r['temp_bytes'])} {g(r['output_bytes'] - r['alias_bytes'])} {g(r['peak_bytes'])} "
        f"{hbm / GIB:6.1f} {fits:>4} {flops} {r['compile_seconds']:7.1f}"
    )


HEADER = (
    f"{'mesh':>16} {'remat':>19} {'tok/chip':>8} {'args':>7} {'temps':>7} {'out':>7} {'total':>7} "
    f"{'HBM':>6} {'fits':>4} {'TFLOP/chip':>9} {'compile_s':>7}   (GiB per chip)"
)


def main() -> int:
    cfg, fv = parse_config(
        sys.argv[1:], prog="tools.tpu_compile", doc=__doc__.split("\n\n")[1], define_flags=_flags
    )
    if cfg.model.path and not fv["model"].value:  # the shape is model.path's config.json (no weights read)
        preflight_tool("model.path", cfg.model.path, weights=False)
    if not fv["topology"].value:
        raise UsageError("--topology is required (e.g. v5p-16)")
    try:
        slice_ = parse_slice(fv["topology"].value)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not use_libtpu():
        raise UsageError(
            "libtpu not found: run tools/install.sh (it installs the tpu-aot extra's libtpu into "
            "<venv>/tpu-aot) or pip install 'jax[tpu]'"
        )
    # after use_libtpu(): JAX reads its platform settings when it is first imported
    from primejax.trainer.aot import (
        RECOMMEND_REMAT,
        compile_train_step,
        layout_error,
        recommend_meshes,
        resolve_mesh,
        rows_per_rank,
    )

    devices = topology_devices(slice_)
    model_cfg = _model_config(cfg, fv["model"].value)
    seq_len = fv["seq_len"].value or cfg.trainer.fake_data.seq_len
    tokens = fv["tokens_per_chip"].value
    hbm = slice_.chip.hbm_bytes
    print(
        f"{slice_.name} = {slice_.topology}: {slice_.chips} x {slice_.chip.device_kind}, "
        f"{hbm / GIB:.0f} GiB HBM per chip; model {fv['model'].value or cfg.model.path or 'build_tiny'} "
        f"({model_cfg.num_params() / 1e9:.2f}B params), rows of {seq_len} tokens; attention "
        f"{model_cfg.attention_impl}; compile-time figures, not measured speed",
        flush=True,
    )
    if fv["recommend"].value:
        tokens = tokens or seq_len
        sizes = {k: [int(x) for x in fv[f"{k}_sizes"].value.split(",")] for k in ("tensor", "context")}
        candidates = recommend_meshes(
            slice_.chips, model_cfg, seq_len, tokens, sizes["tensor"], sizes["context"]
        )
        if not candidates:
            raise UsageError(f"no mesh gives {tokens} tokens per chip with rows of {seq_len} tokens")
        plans = [(mesh, remat) for mesh in candidates for remat in RECOMMEND_REMAT]
    else:
        try:
            mesh = resolve_mesh(cfg.trainer.mesh.to_dict(), slice_.chips)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if err := layout_error(model_cfg, mesh, seq_len):
            raise UsageError(err)
        plans = [(mesh, model_cfg.remat_policy)]
    print(HEADER, flush=True)
    reports = []
    for mesh, remat in plans:
        rows = rows_per_rank(slice_.chips, mesh, seq_len, tokens) if tokens else None
        if tokens and rows is None:
            raise UsageError(
                f"--tokens_per_chip {tokens} with rows of {seq_len} tokens does not divide over {mesh}"
            )
        m_cfg = dataclasses.replace(model_cfg, remat_policy=remat)
        kw = dict(
            seq_len=seq_len,
            micro_batch_size=rows,
            micro_batches=fv["micro_batches"].value,
            max_segments=fv["max_segments"].value,
            hbm_bytes=hbm,
            mesh_sizes=mesh,
        )
        compiled, report = compile_train_step(cfg, m_cfg, devices, **kw)
        r = report.to_dict()
        # what the step moves between chips, by collective kind (primejax/trainer/hlo_collectives.py)
        r["collective_bytes"] = collective_bytes(compiled.as_text()) if compiled is not None else {}
        r.update(
            topology=slice_.name,
            chips=slice_.chips,
            hbm_bytes=hbm,
            fits=not r["out_of_memory"] and r["peak_bytes"] <= hbm,
            model=fv["model"].value or cfg.model.path,
            remat_setting=remat,
        )
        reports.append(r)
        print(_line(r, hbm), flush=True)
        if r["collective_bytes"]:
            moved = ", ".join(f"{k} {v / GIB:.2f}" for k, v in sorted(r["collective_bytes"].items()))
            print(f"{'':>16} collectives, GiB per chip per step: {moved}", flush=True)
        if fv["recommend"].value and r["fits"]:
            break  # plans are in order of preference: the first that fits is the pick
    best = None
    if fv["recommend"].value:
        fitting = [r for r in reports if r["fits"]]
        best = (
            min(fitting, key=lambda r: (r["flops"], r["mesh"]["tensor"], r["mesh"]["context"]))
            if fitting
            else None
        )
        if best is None:
            print(f"recommend: nothing tried fits {slice_.name} at {tokens} tokens per chip")
            if tokens >= seq_len:
                print(
                    f"recommend: --tokens_per_chip {seq_len // 2} (or less) splits each row of {seq_len} "
                    "tokens over chips with context parallelism"
                )
        else:
            mesh = best["mesh"]
            print(
                f"recommend: mesh data={mesh['data']} fsdp={mesh['fsdp']} context={mesh['context']} "
                f"tensor={mesh['tensor']}, remat {best['remat_setting']} ({best['peak_bytes'] / GIB:.1f} of "
                f"{hbm / GIB:.0f} GiB, {best['flops'] / 1e12:.1f} TFLOP per chip per micro-batch): "
                f"--config.trainer.mesh.fsdp={mesh['fsdp']} --config.trainer.mesh.context={mesh['context']} "
                f"--config.trainer.mesh.tensor={mesh['tensor']} --config.model.remat_policy="
                f"{best['remat_setting']} --config.trainer.micro_batch_size="
                f"{rows_per_rank(slice_.chips, mesh, seq_len, tokens)}"
            )
    if fv["json"].value:
        out = Path(fv["json"].value)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps({"reports": reports, "recommended": best}, indent=1))
        tmp.replace(out)
    return 0 if reports else 1


if __name__ == "__main__":
    run_main(main)
