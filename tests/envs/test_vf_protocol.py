"""verifiers' Env protocol as primejax drives it in process, with a scripted model (no server): the Env a
taskset ships runs by id (textarena Hangman: the game engine plays the user and scores the game), self-play
seats (verifiers' kuhn-poker example: which seat trains, the other sampling untrained), `setup_task` receiving
the TaskData, ids resolved as verifiers resolves them, and import errors reported as themselves."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from primejax.envs.registry import load_env
from primejax.envs.verifiers_ids import EnvLoadError, resolve_taskset

ROOT = Path(__file__).resolve().parents[2]


class Scripted:
    """A ModelCall answering from `reply(messages, tools)`; records which calls were trained."""

    def __init__(self, reply, max_calls: int = 8):
        self.reply, self.max_calls = reply, max_calls
        self.calls: list[tuple[bool, list[dict]]] = []

    async def __call__(self, messages, tools=None, *, trainable=True):
        if trainable and sum(t for t, _ in self.calls) >= self.max_calls:
            return None  # the orchestrator's turn cap
        self.calls.append((trainable, list(messages)))
        return self.reply(messages, tools)


def play(env, index: int, model) -> tuple[list[dict], float, dict]:
    example, state = env.example(index), {}

    async def main():
        messages = await env.rollout(example, state, model)
        return messages, await env.score(example, messages, state)

    messages, reward = asyncio.run(main())
    return messages, reward, state


def test_textarena_by_id_runs_the_env_it_ships_and_the_game_scores(offline_words):
    env = load_env("textarena", {"game": "Hangman-v0", "num_examples": 2})
    assert type(env.vf_env).__name__ == "TextArenaEnv"
    assert env.example(0).prompt == []  # the Env opens the conversation (the seeded board is the task prompt)
    guesses = iter(["I guess [e]", "Then [p]", "The word is [apple]"])
    model = Scripted(lambda messages, tools: {"role": "assistant", "content": next(guesses)})
    messages, reward, state = play(env, 0, model)
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert "Hangman" in users[0] and len(users) == 3  # the board, then the engine's feedback on each move
    assert "P" in users[2] or "p" in users[2]
    assert reward == 1.0 and state["reward_components"] == {"game_reward": 1.0}
    assert state["stop_condition"] == "user_closed"  # the game ended; the env closed the exchange


def test_kuhn_poker_self_play_trains_one_seat_the_other_plays_untrained(vf_examples):
    env = load_env("kuhn-poker", {"num_examples": 4})
    assert type(env.vf_env).__name__ == "KuhnPokerEnv"
    model = Scripted(lambda messages, tools: {"role": "assistant", "content": "[check]"})
    for index, seat in ((0, "Player 0"), (1, "Player 1")):  # seats rotate over examples (both trainable)
        model.calls.clear()
        messages, reward, state = play(env, index, model)
        assert [t for t, _ in model.calls] == [index == 0, index == 1]  # check-check: one move per seat
        assert seat in messages[0]["content"]  # the trained seat's own conversation (its private card)
        assert state["reward_components"]["payoff"] == reward and abs(reward) == 1.0
        assert state["metrics"] == {"forfeit": 0.0}
    # A seat that never gets a turn (player 0 forfeits with two illegal replies) trains nothing: the episode is
    # played again training the next seat.
    model = Scripted(lambda messages, tools: {"role": "assistant", "content": "no idea"})
    messages, reward, state = play(env, 1, model)
    assert [t for t, _ in model.calls] == [False, False, True, True]
    assert "Player 0" in messages[0]["content"] and reward == -1.0 and state["metrics"] == {"forfeit": 1.0}
    pinned = load_env("kuhn-poker", {"num_examples": 4, "policy_agent": "player1"})
    model = Scripted(lambda messages, tools: {"role": "assistant", "content": "[check]"})
    messages, reward, _ = play(pinned, 0, model)
    assert [t for t, _ in model.calls] == [False, True] and "Player 1" in messages[0]["content"]
    with pytest.raises(ValueError, match="not seats of this env"):
        load_env("kuhn-poker", {"num_examples": 4, "policy_agent": "dealer"})


def test_setup_task_receives_the_task_data():
    env = load_env("tests.envs.vf_taskdata_taskset", {})

    def reply(messages, tools):
        if messages[-1]["role"] == "tool":
            return {"role": "assistant", "content": f"Inside: {messages[-1]['content']}"}
        call = {"id": "c0", "type": "function", "function": {"name": "vault_open", "arguments": "{}"}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}

    messages, reward, _ = play(env, 1, Scripted(reply))
    assert messages[-2] == {"role": "tool", "tool_call_id": "c0", "name": "vault_open", "content": "v1:opal"}
    assert reward == 1.0


def test_a_shared_taskset_toolset_keeps_each_rollouts_state_apart(vf_examples):
    """verifiers' scratchpad example: one taskset-scoped server for every rollout; `roundtrip` writes the word to
    the rollout's `State`, sleeps, reads it back. Concurrent rollouts must each read their own word."""
    env = load_env("scratchpad", {})

    def reply(messages, tools):
        if messages[-1]["role"] == "tool":
            return {"role": "assistant", "content": messages[-1]["content"]}
        word = messages[-1]["content"].split('word="')[1].split('"')[0]
        call = {
            "id": "c0",
            "type": "function",
            "function": {"name": "scratchpad_roundtrip", "arguments": json.dumps({"word": word})},
        }
        return {"role": "assistant", "content": "", "tool_calls": [call]}

    async def one(index):
        example, state = env.example(index), {}
        messages = await env.rollout(example, state, Scripted(reply))
        return messages, await env.score(example, messages, state)

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(4)))
        return results, await env.shared_toolsets()

    results, shared = asyncio.run(main())
    assert [r for _, r in results] == [1.0] * 4  # every rollout read back its own word
    assert [m[-1]["content"] for m, _ in results] == [env.tasks[i].data.word for i in range(4)]
    assert [type(t).__name__ for t, _ in shared] == ["ScratchpadToolset"]  # one instance for every rollout


def test_ids_resolve_as_verifiers_resolves_them(offline_words):
    from verifiers.v1.tasksets.textarena import TextArenaEnv, TextArenaTaskset

    assert resolve_taskset("textarena") == (
        TextArenaTaskset,
        TextArenaEnv,
    )  # verifiers' taskset, not the game
    assert resolve_taskset("verifiers.v1.tasksets.textarena") == (TextArenaTaskset, TextArenaEnv)
    taskset, shipped = resolve_taskset("tests.envs.vf_taskdata_taskset")
    assert taskset.__name__ == "SecretTaskset" and shipped is None


def test_an_import_error_inside_a_taskset_package_is_reported_as_itself(tmp_path, monkeypatch):
    with pytest.raises(
        EnvLoadError,
        match="importing 'tests.envs.vf_broken_taskset' failed: ModuleNotFoundError: "
        "No module named 'primejax_missing_dependency'",
    ):
        load_env("tests.envs.vf_broken_taskset", {})
    package = tmp_path / "half_installed_taskset"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('bad install: data file missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        EnvLoadError, match="importing 'half_installed_taskset' failed: RuntimeError: bad install"
    ):
        load_env("half-installed-taskset", {})
    old = tmp_path / "old_api_taskset"
    old.mkdir()
    (old / "__init__.py").write_text("import verifiers as vf\n\nparser = vf.XMLParser(['answer'])\n")
    with pytest.raises(EnvLoadError, match=r"AttributeError: .*XMLParser.* targets verifiers < 0.4"):
        load_env("old-api-taskset", {})
    with pytest.raises(EnvLoadError, match="no module 'surely_not_a_taskset' is installed"):
        load_env("surely-not-a-taskset", {})


def test_dry_run_reports_each_broken_env_in_one_line_before_rendering_the_others(tmp_path, tiny_model_dir):
    """`primejax.train --dry_run` on a config with a healthy builtin env, a taskset whose import fails and one
    whose loading raises: exit 1, one line per env, the broken ones' lines first (printed before the tokenizer
    is loaded to render the healthy env's prompt). How fast is measured in docs/benchmarks.md, not here."""
    config = tmp_path / "three_envs.py"
    config.write_text(
        "from primejax.config import default_config, env\n\n"
        "def get_config():\n"
        "    c = default_config()\n"
        f"    c.run.output_dir = {str(tmp_path)!r}\n"
        f"    c.model.path = {str(tiny_model_dir)!r}\n"
        # named to sort after the healthy `reverse_text` (config order): the broken ones must still come first
        "    c.orchestrator.envs.z_broken = env('tests.envs.vf_broken_taskset')\n"
        "    c.orchestrator.envs.z_raising = env('tests.envs.vf_raising_taskset')\n"
        "    return c\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "primejax.train", "--config", str(config), "--dry_run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    json.loads(proc.stdout)  # the resolved config is still printed
    lines = [line for line in proc.stderr.splitlines() if " env " in f" {line}"]
    assert len(lines) == 3, proc.stderr
    broken, raising, healthy = lines
    assert broken.startswith("error: env z_broken (tests.envs.vf_broken_taskset): cannot load:"), broken
    assert "No module named 'primejax_missing_dependency'" in broken
    assert raising == (
        "error: env z_raising (tests.envs.vf_raising_taskset): cannot load: "
        "FileNotFoundError: tasks.jsonl: the taskset's data file is missing"
    ), raising
    assert healthy.startswith("# env reverse_text (reverse-text): ok, "), healthy
    assert "first prompt" in healthy, healthy


def test_a_missing_nltk_resource_is_quoted_by_its_meaningful_line():
    """Issue 48: `--dry_run` on textarena's wordle offline said `cannot load: LookupError: ****...` (the first
    line of NLTK's banner); the line that names the missing resource is the one quoted now."""
    nltk = pytest.importorskip("nltk")
    from primejax.launcher.envcheck import _one_line

    with pytest.raises(LookupError) as e:
        nltk.data.find("taggers/primejax_no_such_resource")
    assert _one_line(e.value) == "LookupError: Resource 'primejax_no_such_resource' not found."


def test_the_env_check_renders_the_first_prompt_an_env_sends(vf_examples):
    """For an Env that opens the conversation itself, the check's prompt is its first model call's."""
    from primejax.launcher.envcheck import first_prompt

    messages, tools = asyncio.run(first_prompt(load_env("kuhn-poker", {"num_examples": 2})))
    assert [m["role"] for m in messages] == ["system", "user"] and tools is None
    assert "Kuhn poker as Player 0" in messages[0]["content"]
    assert messages[1]["content"].startswith("Betting so far: nothing yet. You are Player 0.")
