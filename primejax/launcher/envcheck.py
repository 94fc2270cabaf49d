"""`--dry_run`'s environment check: load every `orchestrator.envs` entry and render one prompt of each, so an
env problem (a taskset that does not import, a bad arg, a prompt over `orchestrator.max_prompt_tokens`) shows
in seconds, before any server starts. An env whose own episode opens the conversation (a verifiers Env) is run
up to its first model call, whose messages are the prompt rendered."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from primejax.envs.base import Environment, Message


class _FirstCall(Exception):
    """Ends an episode at its first model call (the check needs only that prompt)."""

    def __init__(self, messages: list[Message], tools: list[dict[str, Any]] | None):
        super().__init__("first model call")
        self.messages, self.tools = messages, tools


async def first_prompt(env: Environment) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The messages (and tools) of example 0's first model call."""
    example = env.example(0)
    if not env.drives_rollout or example.prompt:
        return list(example.prompt), await env.tools(example)

    async def model(messages: list[Message], tools: Any = None, *, trainable: bool = True) -> Message | None:
        raise _FirstCall(list(messages), tools)

    try:
        await env.rollout(example, {}, model)
    except _FirstCall as call:
        return call.messages, call.tools
    raise RuntimeError("its episode finished without calling the model")


def _one_line(e: BaseException) -> str:
    """The error's first line that says something: NLTK's LookupError, e.g., opens with a banner of asterisks
    before `Resource 'averaged_perceptron_tagger_eng' not found.`"""
    lines = [ln.strip() for ln in str(e).splitlines()]
    said = next((ln for ln in lines if any(c.isalnum() for c in ln)), "")
    return f"{type(e).__name__}: {said}"


def check_envs(cfg: Any, report: Callable[[bool, str], None] | None = None) -> list[tuple[bool, str]]:
    """(ok, line) per `orchestrator.envs` entry of a typed config. `report` is called with each line as soon
    as it is known: an env that fails to load is reported before the tokenizer (transformers, torch: seconds)
    is loaded to render the others' prompts."""
    from primejax.envs.registry import load_env

    def done(name: str, ok: bool, line: str) -> None:
        lines[name] = (ok, line)
        if report is not None:
            report(ok, line)

    o = cfg.orchestrator
    lines: dict[str, tuple[bool, str]] = {}
    prompts: dict[str, tuple[str, list[Message], list[dict[str, Any]] | None]] = {}
    from primejax.launcher.preflight import env_id_problem

    for name, entry in o.envs.items():  # load and open every env first: its failures need no tokenizer
        problem = env_id_problem(entry.id)  # the launcher's own line for an id that resolves to nothing
        if problem:
            done(name, False, f"orchestrator.envs.{name}.id: {problem}")
            continue
        try:
            env = load_env(entry.id, dict(entry.args))
        except Exception as e:  # noqa: BLE001 - every env problem is one line, the check goes on
            done(name, False, f"env {name} ({entry.id}): cannot load: {_one_line(e)}")
            continue
        size = "unbounded" if env.num_examples is None else f"{env.num_examples} examples"
        try:
            prompts[name] = (size, *asyncio.run(first_prompt(env)))
        except Exception as e:  # noqa: BLE001
            done(
                name,
                False,
                f"env {name} ({entry.id}): loads ({size}) but its first prompt fails: {_one_line(e)}",
            )
    renderer, why = _renderer(cfg) if prompts else (None, "")
    for name, (size, messages, tools) in prompts.items():
        entry = o.envs[name]
        if renderer is None:
            done(name, True, f"env {name} ({entry.id}): ok, {size}; prompt not rendered ({why})")
            continue
        n = len(renderer.render_ids(messages, tools))
        ok = n <= o.max_prompt_tokens
        verdict = "ok" if ok else f"first prompt over orchestrator.max_prompt_tokens={o.max_prompt_tokens}"
        tooled = f", {len(tools)} tools" if tools else ""
        done(name, ok, f"env {name} ({entry.id}): {verdict}, {size}, first prompt {n} tokens{tooled}")
    return [lines[name] for name in o.envs]


def _renderer(cfg: Any) -> tuple[Any, str]:
    if not (Path(cfg.model.path) / "tokenizer_config.json").exists():
        return None, f"no tokenizer at model.path ({cfg.model.path}) yet"
    from primejax.rendering.renderer import build_renderer, load_tokenizer

    try:
        return build_renderer(cfg.orchestrator.renderer.name, load_tokenizer(cfg.model.path)), ""
    except Exception as e:  # noqa: BLE001 - the envs are checked without their token counts
        return None, f"the tokenizer at model.path does not load: {_one_line(e)}"
