"""Convert model parameters between an Orbax checkpoint and an HF safetensors directory.

  python -m tools.convert_checkpoint to-hf --orbax CKPT --config MODEL_DIR --out OUT [--dtype bfloat16|float32|keep]
  python -m tools.convert_checkpoint to-orbax --hf MODEL_DIR --out CKPT [--param-dtype float32|bfloat16]
  python -m tools.convert_checkpoint merge-lora --base MODEL_DIR --adapter ADAPTER_DIR --out OUT [--dtype ...]

An Orbax parameter checkpoint does not describe the architecture: `--config` names an HF directory (or a
config.json) for it, and tokenizer / generation files found there are copied into the output. The output
directory appears atomically (written under a temporary name, then renamed). `merge-lora` writes the base HF
model with a PEFT LoRA adapter directory merged in (W + s·A·B; models/lora_io.py, docs/lora.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from primejax.launcher.preflight import preflight_tool

# The model code (JAX, Orbax) is imported where it is used: a bad argument is refused in a second, not after
# seconds of imports.


def to_hf(orbax_dir: str, config: str, out: str, dtype: str | None, overwrite: bool = False) -> dict:
    from primejax.models.checkpoint import restore_params, saved_param_dtype
    from primejax.models.config import ModelConfig
    from primejax.models.hf_io import export_safetensors
    from primejax.utils.io import atomic_dir

    config_path = Path(config)
    model_dir = config_path if config_path.is_dir() else config_path.parent
    param_dtype = saved_param_dtype(orbax_dir) or "float32"
    cfg = ModelConfig.from_model_dir(model_dir, param_dtype=param_dtype)
    model = restore_params(orbax_dir, cfg)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        return export_safetensors(model, cfg, tmp, dtype=dtype, src_dir=model_dir)


def to_orbax(hf_dir: str, out: str, param_dtype: str, overwrite: bool = False) -> None:
    from primejax.models.checkpoint import save_params
    from primejax.models.hf_io import load_model

    model, _ = load_model(hf_dir, param_dtype=param_dtype)
    out_path = Path(out)
    if out_path.exists():
        if not overwrite:
            raise FileExistsError(f"{out} already exists (pass --overwrite)")
        shutil.rmtree(out_path)
    save_params(out_path, model)  # Orbax finalizes the directory with an atomic rename


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.convert_checkpoint", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-hf", help="Orbax parameter checkpoint -> HF safetensors directory")
    a.add_argument("--orbax", required=True, help="Orbax checkpoint directory written by save_params")
    a.add_argument(
        "--config", required=True, help="HF model directory (or its config.json) of the architecture"
    )
    a.add_argument("--out", required=True)
    a.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "keep"])
    a.add_argument("--overwrite", action="store_true")
    b = sub.add_parser("to-orbax", help="HF safetensors directory -> Orbax parameter checkpoint")
    b.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    b.add_argument("--out", required=True)
    b.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    b.add_argument("--overwrite", action="store_true")
    c = sub.add_parser(
        "merge-lora", help="HF base model + PEFT LoRA adapter -> merged HF safetensors directory"
    )
    c.add_argument("--base", required=True, help="HF model directory the adapter was trained on")
    c.add_argument(
        "--adapter", required=True, help="PEFT adapter directory (adapter_config.json + safetensors)"
    )
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "keep"])
    c.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    # The model directory it reads, checked as the entrypoints check theirs: one line and exit 2, no traceback.
    if args.cmd == "to-hf":  # --config: the architecture only (a directory or its config.json)
        arch = Path(args.config)
        preflight_tool("--config", arch.parent if arch.name == "config.json" else arch, weights=False)
    elif args.cmd == "merge-lora":
        preflight_tool("--base", args.base, weights=True)
    else:
        preflight_tool("--hf", args.hf, weights=True)
    from primejax.models.lora_io import AdapterError

    try:
        if args.cmd == "to-hf":
            dtype = None if args.dtype == "keep" else args.dtype
            stats = to_hf(args.orbax, args.config, args.out, dtype, args.overwrite)
            print(
                f"wrote {args.out}: {stats['bytes'] / 2**20:.1f} MiB in {stats['files']} file(s), "
                f"{stats['seconds']:.2f} s"
            )
        elif args.cmd == "merge-lora":
            from primejax.models.lora_io import merge_peft

            dtype = None if args.dtype == "keep" else args.dtype
            stats = merge_peft(args.base, args.adapter, args.out, dtype=dtype, overwrite=args.overwrite)
            print(f"wrote {args.out}: {stats['bytes'] / 2**20:.1f} MiB merged, {stats['seconds']:.2f} s")
        else:
            to_orbax(args.hf, args.out, args.param_dtype, args.overwrite)
            print(f"wrote {args.out}")
    except (FileNotFoundError, FileExistsError, ValueError, KeyError, AdapterError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
