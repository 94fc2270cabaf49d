"""Each built-in algorithm end to end on CPU: one orchestrator step against real vLLM servers writes a batch the
trainer's `read_batch` accepts, and one jitted trainer step on it has the intended loss components non-empty.

The policy is `vllm_server` (tiny tied Qwen3). opd's teacher and sft's frozen source are the same session server
through their own clients: what these tests check (which client each env samples or scores with, and the loss
components of the batch) needs no second model, and a second server would cost the default tier a vLLM start.
Every batch is padded to one shape so the trainer step compiles once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax
import pytest
from ml_collections import ConfigDict
from orch_fakes import make_orchestrator, small_config

from primejax.contracts.batch import read_batch, step_dir
from primejax.inference.client import InferenceClient
from primejax.rendering.renderer import load_tokenizer

pytestmark = pytest.mark.vllm
ROWS, SEQ_LEN = 8, 512


@pytest.fixture(scope="module")
def trainer_step(tiny_model_dir):
    """(jitted train step, initial state): a random-init trainer model of the served architecture."""
    from primejax.models.config import ModelConfig
    from primejax.models.sharding import make_mesh
    from primejax.models.transformer import init_model
    from primejax.trainer import optim
    from primejax.trainer.engine import jit_train_step
    from primejax.trainer.losses import LossConfig
    from primejax.trainer.step import init_state, make_train_step

    cfg = ModelConfig.from_model_dir(
        tiny_model_dir, param_dtype="float32", compute_dtype="float32", attention_impl="xla"
    )
    from flax import nnx

    model = init_model(cfg, None, seed=0)
    sched = optim.make_schedule(1e-3)
    opt = optim.make_optimizer(
        {"lr": 1e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "max_norm": 1.0}, sched
    )
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = init_state(model, opt, mesh=mesh)
    step = jit_train_step(
        make_train_step(nnx.graphdef(model), opt, sched, LossConfig(), chunk_size=256), state, mesh
    )
    return step, [state], cfg.vocab_size  # the step donates its state: the holder keeps the newest


def orchestrate(run_dir: Path, model_dir: Path, policy_url: str, **setup) -> dict[str, float]:
    cfg = small_config(
        run_dir, batch_size=4, group_size=2, async_level=0
    )  # seeded sampling: one step, no trainer
    cfg.model.path = str(model_dir)
    o = cfg.orchestrator
    o.update({"seq_len": SEQ_LEN, "max_prompt_tokens": 256})
    o.sampling.update({"max_tokens": 24, "seed": 7})
    o.filters.post_batch = ()  # a random tiny model's rewards may tie: ship everything
    if "env_id" in setup:
        o.envs.reverse_text.id = setup.pop("env_id")
        o.envs.reverse_text.args = ConfigDict(setup.pop("env_args"))
    for key, value in setup.items():
        if isinstance(value, dict):
            o.algo[key].update(value)
        else:
            o.algo[key] = value
    tokenizer = load_tokenizer(str(model_dir))

    async def main():
        client = InferenceClient(policy_url, timeout_s=120, max_retries=2)
        orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=run_dir)
        try:
            return (await orch.run(1))[0]
        finally:
            await orch.close()
            await client.close()

    return asyncio.run(main())


def train_on(run_dir: Path, trainer_step) -> dict[str, float]:
    from primejax.trainer.step import to_micro_batches

    step, holder, vocab = trainer_step
    batch = read_batch(step_dir(run_dir, 1) / "rank_0.npz", vocab_size=vocab)
    assert batch.rows <= ROWS and batch.seq_len == SEQ_LEN
    holder[0], metrics = step(holder[0], to_micro_batches(batch.pad_rows(ROWS), ROWS))
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
    assert out["nonfinite"] == 0
    return out


CASES = {
    "grpo": ({}, {"rl"}),
    "max_rl": ({"type": "max_rl"}, {"rl"}),
    "echo": (
        {
            "type": "echo",
            "roles": {"user": 0.1},
            "env_id": "alphabet-sort",
            "env_args": {"num_turns": 2, "initial_names": 2, "names_per_turn": 1},
        },
        {"rl", "ce"},
    ),
    "opd": ({"type": "opd", "teacher": "frozen"}, {"ref_kl"}),
    "sft": ({"type": "sft", "sampling": "frozen"}, {"ce"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_algorithm_step_feeds_the_trainer_its_loss_components(
    name, tmp_path, vllm_server, tiny_model_dir, trainer_step
):
    setup, components = CASES[name]
    setup = dict(setup)
    if setup.get("teacher") == "frozen" or setup.get("sampling") == "frozen":
        ref = {
            "name": "",
            "base_url": (vllm_server.base_url + "/v1",),
        }  # a client of its own, the same server
        if setup.get("teacher"):
            setup["teacher"] = ref
        else:
            setup["sampling"] = {"source": "frozen", "frozen": ConfigDict(ref)}
    m = orchestrate(tmp_path / "run", tiny_model_dir, vllm_server.base_url, **setup)
    assert m["rollouts/errored"] == 0 and m["batch/rollouts"] == 4
    if name == "echo":
        assert m["turns/mean"] == 2.0
    metrics = train_on(tmp_path / "run", trainer_step)
    for c in ("rl", "ce", "ref_kl"):
        assert (metrics[f"tokens/{c}"] > 0) == (c in components), (c, metrics[f"tokens/{c}"])
        assert metrics[f"loss/{c}"] == 0.0 or c in components


def test_offline_eval_of_a_weights_dir_against_the_server(tmp_path, vllm_server, tiny_model_dir):
    from test_vllm_integration import write_perturbed

    from primejax.entrypoints.eval import run_eval

    weights = tmp_path / "broadcasts" / "step_3"
    weights.mkdir(parents=True)
    write_perturbed(tiny_model_dir, weights, seed=3)
    cfg = small_config(tmp_path / "run")
    cfg.model.path = str(tiny_model_dir)
    cfg.inference.enabled = False
    cfg.orchestrator.client.base_urls = (vllm_server.base_url,)
    cfg.orchestrator.eval.update({"num_examples": 3, "group_size": 2})
    cfg.orchestrator.sampling.max_tokens = 16
    m = asyncio.run(run_eval(cfg, str(weights)))
    assert m["eval/weights_version"] == 3.0 and m["eval/reverse_text/num_rollouts"] == 6
    assert 0.0 <= m["eval/reverse_text/pass@2"] <= 1.0 and "eval/reverse_text/reward/mean" in m

    async def version():
        async with InferenceClient(vllm_server.base_url) as c:
            return await c.weights_version()

    assert asyncio.run(version()) == 0  # the shared server is back on the base model


def test_sft_env_from_a_frozen_source_next_to_a_grpo_env_on_the_policy(
    tmp_path, vllm_server, tiny_model_dir, trainer_step
):
    """Reference 001's per-env algorithms: in one run of 2 steps, env `distill` runs sft sampled from a frozen
    server and env `reverse_text` runs grpo on the policy. Every sample of the written batches carries only ce
    tokens (distill) or only rl tokens (grpo), and one trainer step on each batch trains both components. The
    frozen source is the session server through a client of its own (module docstring)."""
    frozen = vllm_server
    from primejax.config import env, typed
    from primejax.orchestrator.loop import Orchestrator

    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, batch_size=8, group_size=2, async_level=1)  # two steps from the base policy
    cfg.model.path = str(tiny_model_dir)
    o = cfg.orchestrator
    o.update({"seq_len": SEQ_LEN, "max_prompt_tokens": 256})
    o.sampling.max_tokens = 24
    o.filters.post_batch = ()
    o.envs["distill"] = env("reverse-text", seed=7)
    o.envs.distill.algo.type = "sft"
    o.envs.distill.algo.sampling.update({"source": "frozen", "frozen": {"base_url": (frozen.base_url,)}})
    o.envs.reverse_text.algo.type = "grpo"
    o.envs.reverse_text.algo.length_penalty.update({"type": "tokens", "coef": 0.01})
    c = typed(cfg)
    tokenizer = load_tokenizer(str(tiny_model_dir))

    async def main():
        client = InferenceClient(vllm_server.base_url, timeout_s=120, max_retries=2)
        orch = Orchestrator(
            c.orchestrator, client=client, tokenizer=tokenizer, run_dir=run_dir, pad_rows_to_multiple=ROWS
        )
        assert orch.buffer.envs["distill"].algorithm.sampling_client.base_urls == [frozen.base_url]
        assert orch.buffer.envs["reverse_text"].algorithm.sampling_client is None  # samples from the policy
        try:
            return [await orch.step(step) for step in (1, 2)], orch
        finally:
            await orch.close()
            await client.close()

    results, orch = asyncio.run(main())
    step, holder, vocab = trainer_step
    from primejax.trainer.step import to_micro_batches

    for result in results:
        batch = read_batch(step_dir(run_dir, result.step) / "rank_0.npz", vocab_size=vocab)
        segments = {}
        for row in range(batch.rows):
            for seg in set(batch.segment_ids[row].tolist()) - {0}:
                where = batch.segment_ids[row] == seg
                trained = where & batch.loss_mask[row]
                segments[tuple(batch.tokens[row][where].tolist())] = (
                    float(batch.rl_weights[row][trained].sum()),
                    float(batch.ce_weights[row][trained].sum()),
                )
        envs_seen = set()
        for rollout in result.batch:
            for sample in orch.to_samples([rollout]):
                rl, ce = segments[tuple(sample.token_ids)]
                if rollout.env == "distill":
                    assert ce > 0 and rl == 0, (rl, ce)
                else:
                    assert rl > 0 and ce == 0, (rl, ce)
                envs_seen.add(rollout.env)
        assert envs_seen == {"distill", "reverse_text"}
        holder[0], metrics = step(holder[0], to_micro_batches(batch.pad_rows(ROWS), ROWS))
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        assert metrics["tokens/ce"] > 0 and metrics["tokens/rl"] > 0 and metrics["nonfinite"] == 0
