"""`python -m primejax.eval --config configs/x.py [--weights DIR] [--out metrics.json] [--config.KEY=VALUE ...]`

Offline evaluation: samples `orchestrator.eval.group_size` completions for the first `eval.num_examples`
examples of each eval env (`orchestrator.eval.envs`, or the training envs) and prints pass@1, pass@k and
reward metrics as JSON. `--weights` is a broadcast directory (`broadcasts/step_N`) or any HF safetensors
directory of the same architecture: it is loaded into the server in place (POST /update_weights) on top of
`model.path`, which supplies the tokenizer. With `inference.enabled` a server is started for the run and
stopped at the end; otherwise `orchestrator.client.base_urls` is used (and its weights are reset after).

Sampling is seeded per request (from `orchestrator.sampling.seed`, or `run.seed` when that is -1), so the same
weights, config and server give the same numbers: unseeded, two evaluations of one checkpoint differed by as
much as 0.113 vs 0.072. (A different server build or device may still sample differently.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from absl import flags

from primejax.config.cli import parse_config, run_main
from primejax.eval.offline import evaluate
from primejax.utils.io import atomic_write_json

if TYPE_CHECKING:
    from primejax.config import Config


async def run_eval(cfg: Config, weights: str | None) -> dict[str, float]:
    """The eval process's work (entry: `python -m primejax.eval`)."""
    from primejax.contracts.rundir import log_path
    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.server import ServerSpec
    from primejax.orchestrator.run import policy_client
    from primejax.utils.sections import replace_key

    server = None
    if cfg.inference.enabled:
        # Its own server loads exactly the directory being evaluated (a checkpoint anywhere, manifest or not).
        spec = ServerSpec.from_config(
            cfg.inference,
            cfg.model.path,
            cfg.run.seed,
            require_stable=False,
            weights_root=str(Path(weights).resolve()) if weights else "",
        )
        server = InferenceServerProcess(spec, log_path(cfg.run_dir, "eval-inference"))
        server.start()
        cfg = replace_key(cfg, "inference.port", spec.port)  # inference.port = 0: the port picked for it
    client = policy_client(cfg.orchestrator.client, cfg.inference)
    try:
        await client.wait_ready(cfg.inference.startup_timeout_s, server)
        return await evaluate(cfg.orchestrator, cfg.model.path, client, weights, seed=cfg.run.seed)
    finally:
        if server is None and weights:
            await client.reload_weights()  # a shared server goes back to the base model
        await client.close()
        if server is not None:
            server.stop()


def _flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "weights", "", "broadcast or HF safetensors directory to evaluate ('' = model.path)", flag_values=fv
    )
    flags.DEFINE_string("out", "", "also write the metrics to this JSON file", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
    cfg, fv = parse_config(
        sys.argv[1:] if argv is None else argv,
        prog="primejax.eval",
        doc=__doc__.split("\n\n")[1],
        define_flags=_flags,
    )
    from primejax.launcher.preflight import check_model_dir, preflight_entrypoint

    preflight_entrypoint("eval", cfg.model.path)
    if fv["weights"].value:
        check_model_dir(fv["weights"].value, key="--weights", need_tokenizer=False)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    metrics = asyncio.run(run_eval(cfg, fv["weights"].value or None))
    print(json.dumps(metrics, indent=1, sort_keys=True))
    if fv["out"].value:
        atomic_write_json(fv["out"].value, metrics)
    return 0


if __name__ == "__main__":
    run_main(main)
