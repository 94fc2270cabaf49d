"""Routing replay in the orchestrator: routed experts asked for on every policy request, decoded, kept per turn,
packed into the batch on exactly the sampled tokens (every turn of a multi-turn sample); config rules; the
batch checks' one-line errors on hostile routed arrays."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from dataclasses import dataclass

import numpy as np
import pytest
from ml_collections import ConfigDict
from orch_fakes import FakeClient, FakeCompletion, make_orchestrator, small_config

from primejax.contracts.batch import (
    MANIFEST_KEY,
    BatchFormatError,
    TrainingSample,
    _sha256,
    pack_samples,
    read_batch,
    step_dir,
    write_batch,
)
from primejax.envs.alphabet_sort import NAMES
from primejax.inference.routed_experts import RoutingShape
from primejax.orchestrator.rollout import Rollout, TrajectoryStep
from primejax.orchestrator.samples import rollout_to_samples

LAYERS, K, E = 2, 2, 4


def experts_at(position: int) -> list[list[int]]:
    """The fake server's routing of a position: distinct experts per layer, a function of the position only."""
    return [[(position + layer) % E, (position + layer + 1) % E] for layer in range(LAYERS)]


def _b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


@dataclass
class RoutedCompletion(FakeCompletion):
    routed_experts: str | None = None


class RoutedClient(FakeClient):
    """FakeClient whose replies carry vLLM's routed_experts when asked (rows from routed_experts_prompt_start =
    prompt_len - 1, one per completion token)."""

    def __init__(self, *a, answer: bool = True, **kw):
        super().__init__(*a, **kw)
        self.asked: list[bool] = []
        self.answer = answer  # False: a server started without routed-expert return ignores the field

    async def generate(self, prompt_token_ids, *, routed_experts=False, **kw):
        self.asked.append(routed_experts)
        out = await super().generate(prompt_token_ids, **kw)
        p = len(prompt_token_ids)
        return [
            RoutedCompletion(
                c.prompt_token_ids,
                c.completion_token_ids,
                c.completion_logprobs,
                c.finish_reason,
                routed_experts=_b64(
                    np.asarray([experts_at(p - 1 + j) for j in range(len(c.completion_token_ids))], np.int64)
                )
                if routed_experts and self.answer
                else None,
            )
            for c in out
        ]


def sort_reply(prompt: str, member: int) -> str:
    """Sorts every name the user has sent so far; member i leaves out the last i names (distinct rewards)."""
    user_turns = [t.split("<|im_end|>")[0] for t in prompt.split("<|im_start|>user\n")[1:]]
    seen = sorted(
        n.strip()
        for t in user_turns
        for n in t.split(":", 1)[1].replace(".", ",").split(",")
        if n.strip() in NAMES
    )
    return "<alphabetical_sorted>\n" + "\n".join(seen[: len(seen) - member]) + "\n</alphabetical_sorted>"


def test_multi_turn_routed_experts_reach_the_batch_on_every_turns_sampled_tokens(tmp_path, tokenizer):
    cfg = small_config(tmp_path / "run", env_id="alphabet-sort", batch_size=4, group_size=2)
    cfg.orchestrator.envs.reverse_text.args = ConfigDict({"num_turns": 3})
    cfg.orchestrator.update({"max_prompt_tokens": 512, "seq_len": 1024})
    cfg.orchestrator.sampling.max_tokens = 200
    client = RoutedClient(tokenizer, replies=sort_reply)
    orch = make_orchestrator(
        cfg, client=client, tokenizer=tokenizer, run_dir=tmp_path / "run", routing=RoutingShape(LAYERS, K, E)
    )
    (metrics,) = asyncio.run(orch.run(1))
    assert metrics["turns/mean"] == 3.0 and metrics["rollouts/errored"] == 0 and all(client.asked)
    batch = read_batch(step_dir(tmp_path / "run", 1) / "rank_0.npz", num_experts=E, routing_shape=(LAYERS, K))
    assert batch.routed_experts.dtype == np.uint8 and batch.routed_experts.shape[2:] == (LAYERS, K)
    assert batch.meta["num_samples"] == 4
    # Marked exactly on the sampled tokens (3 turns per sample), each holding the routing of the position
    # that predicted it: the server's rows, turn by turn, land on the right tokens.
    np.testing.assert_array_equal(batch.routed_mask, batch.loss_mask)
    for row in range(batch.rows):
        for t in np.flatnonzero(batch.routed_mask[row]):
            np.testing.assert_array_equal(
                batch.routed_experts[row, t], experts_at(int(batch.positions[row, t]) - 1)
            )
    assert not batch.routed_experts[~batch.routed_mask].any()


def test_without_routing_replay_nothing_is_asked_or_stored(tmp_path, tokenizer):
    cfg = small_config(tmp_path / "run", batch_size=4, group_size=2)
    client = RoutedClient(tokenizer)
    orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=tmp_path / "run")
    asyncio.run(orch.run(1))
    assert not any(client.asked)
    path = step_dir(tmp_path / "run", 1) / "rank_0.npz"
    assert read_batch(path).routed_experts is None
    with np.load(path) as data:
        assert not {"routed_experts", "routed_mask"} & set(data.files)


def test_a_reply_without_routed_experts_fails_the_rollout_with_one_line(tmp_path, tokenizer):
    cfg = small_config(tmp_path / "run", batch_size=4, group_size=2)
    client = RoutedClient(tokenizer, answer=False)
    orch = make_orchestrator(
        cfg, client=client, tokenizer=tokenizer, run_dir=tmp_path / "run", routing=RoutingShape(LAYERS, K, E)
    )
    group = asyncio.run(orch.generator.group(orch.buffer.envs["reverse_text"], 0, 0, 2, 1))
    assert all("inference.return_routed_experts" in r.error for r in group)


def test_frozen_sampler_turns_stay_unmarked_and_samples_round_trip(tmp_path):
    routed = np.asarray([experts_at(2), experts_at(3)], np.uint8)
    steps = [
        TrajectoryStep([1, 2, 3], [7, 8], [-0.1, -0.2], "stop", 0, routed_experts=routed),
        TrajectoryStep([1, 2, 3, 7, 8, 9], [10], [-0.3], "stop", 0),
    ]  # e.g. a frozen sampler's turn
    r = Rollout(env="e", example_index=0, example=None, group_id=0, steps=steps, reward=1.0)
    r.assign_advantages(1.0)
    (s,) = rollout_to_samples(r, "rl", 1.0, 64, routing=(LAYERS, K))
    assert s.routed_mask == [False, False, False, True, True, False, False]
    np.testing.assert_array_equal(s.routed_experts[3:5], routed)
    (plain,) = rollout_to_samples(r, "rl", 1.0, 64)
    assert plain.routed_experts is None and plain.routed_mask is None
    (batch,) = pack_samples([s], seq_len=16, truncate=True)
    back = read_batch(
        write_batch(tmp_path, 0, batch, {"num_experts": E}), num_experts=E, routing_shape=(LAYERS, K)
    )
    np.testing.assert_array_equal(back.routed_experts[0, :7], s.routed_experts)
    np.testing.assert_array_equal(back.routed_mask[0, :7], s.routed_mask)


# ------------------------------------------------------------------------------------------- batch checks


def _batch():
    experts = np.zeros((6, LAYERS, K), np.uint8)
    experts[3:] = [experts_at(t - 1) for t in range(3, 6)]
    s = TrainingSample(
        [1, 2, 3, 4, 5, 6],
        [False] * 3 + [True] * 3,
        [0.0] * 3 + [-0.5] * 3,
        advantages=[1.0] * 6,
        routed_experts=experts,
        routed_mask=[False] * 3 + [True] * 3,
    )
    (batch,) = pack_samples([s], seq_len=8)
    return batch


def _rewrite(path, arrays_fn=None, manifest_fn=None):
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files if k != MANIFEST_KEY}
        manifest = json.loads(data[MANIFEST_KEY].tobytes())
    if arrays_fn:
        arrays_fn(arrays)
        for name, a in arrays.items():
            if name in manifest["fields"]:
                manifest["fields"][name].update(sha256=_sha256(a), shape=list(a.shape), dtype=a.dtype.str)
    if manifest_fn:
        manifest_fn(manifest)
    buf = io.BytesIO()
    np.savez(buf, **arrays, **{MANIFEST_KEY: np.frombuffer(json.dumps(manifest).encode(), np.uint8)})
    path.write_bytes(buf.getvalue())
    return path


def _set(name, fn):
    def apply(arrays):
        arrays[name] = fn(arrays[name])

    return apply


def _mark_first(m):
    m = m.copy()
    m[0, 0] = True
    return m


def _mark_padding(m):
    m = m.copy()
    m[0, -1] = True
    return m


def _too_large(e):
    e = e.copy()
    e[0, 4, 1, 0] = E
    return e


def _twice(e):
    e = e.copy()
    e[0, 4, 0] = [1, 1]
    return e


HOSTILE = {
    "expert id 4 >= num_experts 4": dict(arrays_fn=_set("routed_experts", _too_large)),
    "same expert twice": dict(arrays_fn=_set("routed_experts", _twice)),
    "routed_mask.*first token": dict(arrays_fn=_set("routed_mask", _mark_first)),
    "routed_mask.*padding": dict(arrays_fn=_set("routed_mask", _mark_padding)),
    "routed_experts.*dtype int32": dict(arrays_fn=_set("routed_experts", lambda e: e.astype(np.int32))),
    "routed_mask.*missing": dict(
        arrays_fn=lambda a: a.pop("routed_mask"), manifest_fn=lambda m: m["fields"].pop("routed_mask")
    ),
    "fields.routed_experts.shape": dict(
        manifest_fn=lambda m: m["fields"]["routed_experts"].update(shape=[1, 8, 2])
    ),
    "routed_experts.*missing from the manifest": dict(
        manifest_fn=lambda m: m["fields"].pop("routed_experts")
    ),
}


@pytest.mark.parametrize("match", list(HOSTILE))
def test_hostile_routed_arrays_get_one_line_naming_the_field(tmp_path, match):
    path = _rewrite(write_batch(tmp_path, 0, _batch()), **HOSTILE[match])
    with pytest.raises(BatchFormatError, match=match) as err:
        read_batch(path, num_experts=E, routing_shape=(LAYERS, K))
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_routed_batch_must_fit_the_readers_model(tmp_path):
    path = write_batch(tmp_path, 0, _batch())
    with pytest.raises(BatchFormatError, match="dense"):
        read_batch(path)
    with pytest.raises(BatchFormatError, match=r"\[2, 2\], the model routes \[3, 2\]"):
        read_batch(path, num_experts=E, routing_shape=(3, K))
    bad = _batch()
    bad.routed_experts[0, 4, 0] = [E + 1, 0]
    with pytest.raises(BatchFormatError, match="num_experts"):  # the writer checks too
        write_batch(tmp_path / "w", 0, bad, {"num_experts": E})


# ------------------------------------------------------------------------------------------------ config


def _model_dir(tmp_path, num_experts):
    from primejax.models.config import ModelConfig

    cfg = ModelConfig(
        model_type="qwen3_moe" if num_experts else "qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=num_experts,
        num_experts_per_tok=2 if num_experts else 0,
        moe_intermediate_size=16 if num_experts else 0,
        mlp_only_layers=(0,) if num_experts else (),
        rope_theta=10000.0,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qk_norm=True,
        attention_bias=False,
        max_position_embeddings=256,
    )
    out = tmp_path / f"model{num_experts}"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    return out


def _config(tmp_path, model, **inference):
    from primejax.config import default_config

    c = default_config()
    c.model.path = str(model)
    c.orchestrator.routing_replay = True
    c.inference.update(inference)
    return c


def test_routing_replay_config_rules_and_server_flag(tmp_path):
    from primejax.config import typed
    from primejax.inference.routed_experts import ROUTED_EXPERTS_FLAG
    from primejax.inference.server import ServerSpec
    from primejax.utils.sections import ConfigError

    moe = _model_dir(tmp_path, 4)
    cfg = typed(_config(tmp_path, moe, return_routed_experts=True))
    assert RoutingShape.of_model_dir(moe) == RoutingShape(2, 2, 4)
    assert ROUTED_EXPERTS_FLAG in ServerSpec.from_config(cfg.inference, str(moe)).argv()
    assert (
        ROUTED_EXPERTS_FLAG
        not in ServerSpec.from_config(typed(_config(tmp_path, moe, enabled=False)).inference, str(moe)).argv()
    )
    with pytest.raises(ConfigError, match="inference.return_routed_experts"):
        typed(_config(tmp_path, moe))
    with pytest.raises(ConfigError, match="orchestrator.routing_replay.*dense"):
        typed(_config(tmp_path, _model_dir(tmp_path, 0), return_routed_experts=True))
    with pytest.raises(ConfigError, match="model.path.*config.json"):
        typed(_config(tmp_path, tmp_path / "nowhere", return_routed_experts=True))
