"""LLM-judge rewards: an environment's reward asks a second model, served by its own OpenAI-compatible server
(a vLLM server at an address; `python -m primejax.inference --config ...` starts one), with its own concurrency.

An env takes its judge from its args (`orchestrator.envs.<name>.args.judge = {"base_url": ..., "model": ...}`),
so it works the same in process and in env worker processes; `Judge(JudgeConfig(**args["judge"]))` builds it,
and `await judge.complete(messages)` returns the judge's reply text. Every judge call of one `Judge` shares its
`max_concurrent` slots, apart from the policy's request slots (`orchestrator.max_concurrent`): a slow judge
holds back only the scoring that waits for it. A call past `timeout_s`, a refused request or a reply without
text raises `JudgeError` with one line, which errors the rollout being scored (counted under `errors/score`).

A verifiers taskset uses verifiers' own judges (`vf.Judge`, the plugged `reference` / `rubric` / `decision`
judges): point their config at the judge's server (`base_url`, `model`, `api_key_var` of `vf.JudgeConfig`,
via the taskset's args); `JudgeConfig.verifiers_client()` gives those fields.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from primejax.utils.sections import Section, option, section


@section
class JudgeConfig(Section):
    """One judge model's server and how it is asked."""

    base_url: str = option("", "the judge server's root URL (http://host:port, no /v1)")
    model: str = option("", "the served judge model's name")
    max_concurrent: int = option(4, "judge requests in flight from this env", gt=0, le=4096)
    timeout_s: float = option(60.0, "one judge request's deadline", gt=0)
    max_tokens: int = option(64, "longest judge reply (tokens)", gt=0)
    temperature: float = option(0.0, "the judge's sampling temperature (0: greedy)", ge=0)
    api_key_env: str = option("", "environment variable holding the judge server's API key; '' = none")

    def check(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge.base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.model:
            raise ValueError("judge.model must name the served judge model")

    def verifiers_client(self) -> dict[str, Any]:
        """The endpoint fields of verifiers' `JudgeConfig` for this judge."""
        out: dict[str, Any] = {"base_url": self.base_url.rstrip("/") + "/v1", "model": self.model}
        if self.api_key_env:
            out["api_key_var"] = self.api_key_env
        return out


class JudgeError(RuntimeError):
    """A judge call that gave no verdict (timeout, refused request, malformed reply)."""


class Judge:
    """Chat completions from one judge server, at most `max_concurrent` at a time (module docstring)."""

    def __init__(self, config: JudgeConfig | dict[str, Any]):
        self.config = config if isinstance(config, JudgeConfig) else JudgeConfig(**config)
        self.config.check()
        self._slots: asyncio.Semaphore | None = None
        self.calls = 0  # answered judge calls
        self.in_flight = 0
        self.most_in_flight = 0

    async def complete(self, messages: list[dict[str, Any]]) -> str:
        import httpx

        c = self.config
        if self._slots is None:
            self._slots = asyncio.Semaphore(c.max_concurrent)
        headers = {}
        if c.api_key_env and os.environ.get(c.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[c.api_key_env]}"
        body = {
            "model": c.model,
            "messages": messages,
            "max_tokens": c.max_tokens,
            "temperature": c.temperature,
        }
        url = c.base_url.rstrip("/") + "/v1/chat/completions"
        async with self._slots:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                async with httpx.AsyncClient(timeout=c.timeout_s) as client:
                    response = await client.post(url, json=body, headers=headers)
            except httpx.TimeoutException:
                raise JudgeError(
                    f"judge {c.model!r} at {c.base_url} did not answer within {c.timeout_s:g} s"
                ) from None
            except httpx.HTTPError as e:
                raise JudgeError(f"judge {c.model!r} at {c.base_url}: {type(e).__name__}: {e}") from None
            finally:
                self.in_flight -= 1
        if response.status_code != 200:
            raise JudgeError(f"judge {c.model!r} at {c.base_url} answered HTTP {response.status_code}: "
                             f"{response.text[:200]}")  # fmt: skip
        try:
            text = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(f"judge {c.model!r} at {c.base_url}: a reply without a message: "
                             f"{response.text[:200]!r}") from None  # fmt: skip
        if not isinstance(text, str):
            raise JudgeError(
                f"judge {c.model!r} at {c.base_url}: the reply's content is {type(text).__name__}"
            )
        self.calls += 1
        return text
