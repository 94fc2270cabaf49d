"""docs/environments.md's examples, run as printed: its Python blocks are written to files and loaded by id, and
a group of each is played against a scripted model (tests/orchestrator/orch_fakes.py's FakeClient, no server)."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from primejax.envs.registry import load_env
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.rendering.renderer import build_renderer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "orchestrator"))
from orch_fakes import FakeClient  # noqa: E402


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "environments.md").read_text(), re.S)


class _Version:
    version = 0


class _Algo:
    async def finalize_rollout(self, rollout):
        return None


def _play(env, tokenizer_dir, reply, group_size=2, max_turns=3):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    gen = GroupGenerator(FakeClient(tokenizer, replies=reply), build_renderer("auto", tokenizer),
                         SamplingConfig(max_tokens=32, max_turns=max_turns), _Version(), max_concurrent=4,
                         max_prompt_tokens=1024)  # fmt: skip
    slot = EnvSlot(name="doc", env=env, weight=1.0, algorithm=_Algo())

    async def main():
        try:
            return await gen.group(slot, 0, 0, group_size, 1)
        finally:
            await env.aclose()

    return asyncio.run(main())


@pytest.fixture
def doc_modules(tmp_path, monkeypatch):
    guess, config, taskset = _blocks()
    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "__init__.py").write_text("")
    (tmp_path / "my_envs" / "guess.py").write_text(guess)
    (tmp_path / "my_config.py").write_text(config)
    (tmp_path / "my_echo_taskset.py").write_text(taskset)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_the_primejax_environment_example_loads_from_its_config_and_plays(doc_modules, tiny_model_dir):
    import importlib

    from primejax.config import typed

    cfg = importlib.import_module("my_config").get_config()
    cfg.model.path = str(tiny_model_dir)
    entry = typed(cfg).orchestrator.envs["guess"]
    env = load_env(entry.id, dict(entry.args))
    secret = env.example(0).answer
    low = 1 if secret > 1 else 2  # a wrong first guess, then the right one after the hint

    def reply(prompt, member):
        return f"<guess>{secret if 'No, ' in prompt else low}</guess>"

    rollouts = _play(env, tiny_model_dir, reply)
    for r in rollouts:
        assert r.error is None, r.error
        assert r.reward == 1.0 and len(r.steps) == 2
        assert r.messages[2]["content"] == f"No, {'higher' if low < secret else 'lower'}."


def test_the_verifiers_taskset_example_loads_by_id_and_scores(doc_modules, tiny_model_dir):
    env = load_env("my_echo_taskset", {})
    assert env.example(0).prompt == [{"role": "user", "content": "Say apple"}]

    rollouts = _play(
        env, tiny_model_dir, lambda prompt, member: "apple" if member == 0 else "nope", max_turns=1
    )
    assert [r.error for r in rollouts] == [None, None]
    assert [r.reward for r in rollouts] == [1.0, 0.0]
