"""LLM-judge rewards: an environment's reward asks a second model, served by its own OpenAI-compatible server
(a vLLM server at an address; `python -m primejax.inference --config ...` starts one), with its own concurrency.

An env takes its judge from its args (`orchestrator.envs.<name>.args.judge = {"base_url": ..., "model": ...}`),
so it works the same in process and in env worker processes; `Judge(JudgeConfig(**args["judge"]))` builds it,
and `await judge.complete(messages)` returns the judge's reply text. Every judge call of one `Judge` shares its
`max_concurrent` slots, apart from the policy's request slots (`orchestrator.max_concurrent`): a slow judge
holds back only the scoring that waits for it. A call past `timeout_s`, a refused request or a reply without
text raises `JudgeError` with one line, which errors the rollout being scored (counted under `errors/score`).

The judge's server may be the run's own: with `judge.enabled` (the `judge` section, `JudgeServerConfig`) the
launcher starts a vLLM server for `judge.model_path` before the orchestrator, on its own port with its own
concurrency (`judge.max_concurrent` sequences at once), keeps it up like the policy server (restarts, liveness),
and gives its children its address; an env's judge with `base_url` and `model` left empty then asks that
server.

A verifiers taskset uses verifiers' own judges (`vf.Judge`, the plugged `reference` / `rubric` / `decision`
judges): point their config at the judge's server (`base_url`, `model`, `api_key_var` of `vf.JudgeConfig`,
via the taskset's args); `JudgeConfig.verifiers_client()` gives those fields.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

from primejax.utils.sections import ConfigError, Section, option, section

#: What the launcher tells its children about the judge server it started (an env's judge with no base_url /
#: model asks that one): environment variables, so env worker processes and env servers inherit them.
JUDGE_URL_ENV = "PRIMEJAX_JUDGE_BASE_URL"
JUDGE_MODEL_ENV = "PRIMEJAX_JUDGE_MODEL"


@section
class JudgeServerConfig(Section):
    """The LLM judge's vLLM server, started by the launcher (`python -m primejax.train`) beside the policy's."""

    enabled: bool = option(
        False, "start a judge server; envs reach it with judge.base_url and model left empty"
    )
    model_path: str = option("", "the judge model's local HF directory (weights, tokenizer, chat template)")
    port: int = option(0, "its port; 0 = a free one", ge=0, le=65535)
    max_concurrent: int = option(
        8, "sequences the judge server runs at once (vLLM --max-num-seqs)", gt=0, le=4096
    )
    max_model_len: int = option(2048, "longest judge sequence (prompt + reply)", gt=0, le=1 << 20)
    dtype: str = option("auto", "serving dtype; auto = the checkpoint's own")
    devices: str = option("", "GPUs the judge server may use ('' = those of the policy server)")
    gpu_memory_utilization: float = option(0.3, "its share of a GPU's memory (GPU nodes only)", gt=0, le=1)
    startup_timeout_s: float = option(300.0, "how long its start may take before the run fails", gt=0)

    def check(self) -> None:
        if self.enabled and not self.model_path:
            raise ConfigError("model_path", "must name the judge model when judge.enabled")


@section
class JudgeConfig(Section):
    """One judge model's server and how it is asked."""

    base_url: str = option("", "the judge server's root URL (http://host:port, no /v1); '' = the run's own")
    model: str = option("", "the served judge model's name; '' (with base_url '') = the run's own")
    max_concurrent: int = option(4, "judge requests in flight from this env", gt=0, le=4096)
    timeout_s: float = option(60.0, "one judge request's deadline", gt=0)
    max_tokens: int = option(64, "longest judge reply (tokens)", gt=0)
    temperature: float = option(0.0, "the judge's sampling temperature (0: greedy)", ge=0)
    api_key_env: str = option("", "environment variable holding the judge server's API key; '' = none")

    def check(self) -> None:
        if not self.base_url and not self.model:
            return  # the run's own judge server (`judge.enabled`): its address comes from the launcher
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
        if not self.the_runs_own:
            self.config.check()
        self._slots: asyncio.Semaphore | None = None
        self.calls = 0  # answered judge calls
        self.in_flight = 0
        self.most_in_flight = 0

    @property
    def the_runs_own(self) -> bool:
        """No base_url and no model: the judge server the run's launcher started (`judge.enabled`)."""
        return not self.config.base_url and not self.config.model

    def _resolve(self) -> JudgeConfig:
        """The run's own judge server's address, from the launcher (read at the first call, not at load: the
        config check of `--dry_run` loads envs with no judge server started)."""
        if not os.environ.get(JUDGE_URL_ENV):
            raise JudgeError(
                "judge.base_url is empty and this run started no judge server: set the env's judge base_url "
                "and model, or judge.enabled and judge.model_path in the run's config"
            )
        self.config = dataclasses.replace(
            self.config, base_url=os.environ[JUDGE_URL_ENV], model=os.environ.get(JUDGE_MODEL_ENV, "")
        )
        self.config.check()
        return self.config

    async def complete(self, messages: list[dict[str, Any]]) -> str:
        import httpx

        c = self._resolve() if self.the_runs_own else self.config
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
