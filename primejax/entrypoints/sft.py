"""`python -m primejax.sft --config configs/x.py`: supervised fine-tuning on chat data, the same trainer code.

Reads `sft.data_path` (chat JSONL) or generates demonstrations from an environment's answers (`sft.from_env`),
trains `sft.steps` steps of the ce loss on assistant tokens with the trainer's engine (trainer/engine.py: its
mesh, optimizer and compiled "sft" step) and HF export, and writes the result as an HF directory to
`<run>/sft/final` (fp32, so RL continues from exact master weights). The launcher runs it as a warm-up before RL when `sft.steps > 0`.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from primejax.config.cli import parse_config, run_main
from primejax.contracts.rundir import write_resolved_config
from primejax.sft.loop import SFTError, load_samples, sft_output_dir

if TYPE_CHECKING:
    from primejax.config import Config

log = logging.getLogger("primejax.sft")


def train_sft(cfg: Config) -> Path:
    """The SFT process's work (entry: `python -m primejax.sft`); returns the exported HF directory."""
    from transformers import AutoTokenizer

    from primejax.contracts.batch import pack_samples
    from primejax.models.hf_io import export_safetensors
    from primejax.sft.data import SFTDataError
    from primejax.trainer.engine import Engine
    from primejax.trainer.moe_metrics import expert_devices, flatten_moe_metrics
    from primejax.trainer.optim import make_schedule
    from primejax.utils.io import atomic_dir
    from primejax.utils.monitor import Monitor

    s, m = cfg.sft, cfg.model
    tokenizer = AutoTokenizer.from_pretrained(m.path)
    samples = load_samples(s, cfg.orchestrator.envs, tokenizer)
    if not samples:
        raise SFTDataError("no SFT examples to train on")
    log.info("SFT on %d conversations, %d steps of %d", len(samples), s.steps, s.batch_size)

    # The trainer's engine (mesh, optimizer, compiled step) with SFT's constant learning rate; its "sft" step
    # trains the ce weights of the packed batch whatever `trainer.loss` says about the rl loss.
    engine = Engine.from_settings(
        cfg.trainer, m, seed=cfg.run.seed, lr_schedule=make_schedule(s.lr, "constant")
    )
    model_cfg = engine.model_cfg
    rng = random.Random(cfg.run.seed)
    order: list[int] = []
    skipped = 0
    root = cfg.run_dir
    with Monitor.from_config(root, "sft", cfg.monitor, cfg.to_dict()) as monitor:
        for step in range(1, s.steps + 1):
            if len(order) < s.batch_size:  # epochs of a fresh shuffle
                more = list(range(len(samples)))
                rng.shuffle(more)
                order += more
            chosen, order = order[: s.batch_size], order[s.batch_size :]
            (batch,) = pack_samples([samples[i] for i in chosen], s.seq_len)
            t0 = time.perf_counter()
            metrics, tokens = engine.train(batch, "sft")
            metrics, hists = flatten_moe_metrics(
                metrics, model_cfg.sparse_layers(), expert_devices(model_cfg, engine.mesh)
            )
            for name, values in hists.items():
                monitor.histogram(step, name, values)
            if int(metrics["nonfinite"]):
                skipped += 1
                log.warning(
                    "sft step %d: non-finite loss, gradient or update; skipped (%d so far)", step, skipped
                )
            dt = time.perf_counter() - t0
            monitor.scalars(step, {**metrics, "perf/tokens_per_s": tokens / dt, "time/step_s": dt})
            if step == 1 or step % 10 == 0 or step == s.steps:
                log.info("sft step %d/%d loss %.4f", step, s.steps, float(metrics["loss"]))

    if skipped == s.steps:
        raise SFTError(f"every one of the {s.steps} SFT steps was non-finite: nothing was trained")
    if not engine.params_finite():
        raise SFTError("the SFT parameters are non-finite (NaN/inf): not writing them")
    out = sft_output_dir(root)
    with atomic_dir(out, overwrite=True) as tmp:
        export_safetensors(engine.model(), model_cfg, tmp, dtype=None, src_dir=m.path)
    log.info("SFT model written to %s", out)
    return out


def main() -> int:
    cfg, _ = parse_config(sys.argv[1:], prog="primejax.sft", doc=__doc__.split("\n\n")[1])
    from primejax.launcher.preflight import preflight_entrypoint

    preflight_entrypoint("sft", cfg.model.path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.sft.steps <= 0:
        print("error: sft.steps must be > 0 for primejax.sft", file=sys.stderr)
        return 2
    write_resolved_config(cfg.run_dir, "sft", cfg.to_json())
    from primejax.sft.data import SFTDataError

    try:
        train_sft(cfg)
    except SFTDataError as e:  # the user's data: one line naming file:line, no traceback
        print(f"error: sft.data_path: {e}", file=sys.stderr, flush=True)
        return 2
    except SFTError as e:
        print(f"error: sft: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
