"""A model that answers the calculator taskset (tests/envs/vf_calc_taskset.py) instantly from a script, in
process (`InstantModel`) and behind vLLM's token-in/token-out routes (`InstantServer`), for the tests that drive
verifiers' own loop without a vLLM server. (It timed the two verifiers drivers in the one-off benchmark whose
results docs/verifiers.md records.)"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass
class Done:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str = "stop"
    text: str = ""


class InstantModel:
    """Turn 1: the right calculator call; turn 2: the answer (read from the prompt's tool result)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def reply(self, prompt_token_ids: list[int]) -> list[int]:
        text = self.tok.decode(prompt_token_ids)
        if "<tool_response>" in text:
            reply = text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
        else:
            op = "mul" if "product" in text.rsplit("<|im_start|>user", 1)[1] else "add"
            a, b = [int(w) for w in text.replace("?", " ").split() if w.isdigit()][-2:]
            reply = (
                "<tool_call>\n"
                + json.dumps({"name": f"calc_{op}", "arguments": {"a": a, "b": b}})
                + "\n</tool_call>"
            )
        return self.tok.encode(reply, add_special_tokens=False) + [self.eos]

    async def generate(self, prompt_token_ids, *, n, **_):
        ids = self.reply(list(prompt_token_ids))
        return [Done(list(prompt_token_ids), ids, [-0.1] * len(ids)) for _ in range(n)]


class InstantServer:
    """`InstantModel` behind vLLM's token-in/token-out routes (`/inference/v1/generate`, `/v1/models`), on
    127.0.0.1, for verifiers' train client; also `openai_endpoint()` like primejax's InferenceClient."""

    def __init__(self, model: InstantModel, name: str, api_key_var: str = ""):
        """`api_key_var`: when it names a set variable, every route answers 401 without that bearer key (vLLM's
        --api-key), and clients learn the variable from `api_key_var` as from primejax's InferenceClient."""
        self.model, self.name, self.api_key_var = model, name, api_key_var
        self.unauthorized = 0  # requests refused for a missing or wrong key
        self.base_url = ""
        self.served: list[tuple[list[int], list[int]]] = []  # (prompt ids, completion ids) per request
        self._runner = None

    async def openai_endpoint(self) -> tuple[str, str]:
        return self.base_url, self.name

    async def generate(self, prompt_token_ids, *, n, **kw):
        return await self.model.generate(prompt_token_ids, n=n, **kw)

    async def __aenter__(self) -> InstantServer:
        from aiohttp import web

        async def models(_):
            return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

        async def generate(request):
            body = await request.json()
            ids = self.model.reply(list(body["token_ids"]))
            self.served.append((list(body["token_ids"]), ids))
            content = [{"token": f"token_id:{t}", "logprob": -0.1} for t in ids]
            choice = {"index": 0, "token_ids": ids, "finish_reason": "stop", "logprobs": {"content": content}}
            return web.json_response(
                {"request_id": "instant", "prompt_token_ids": body["token_ids"], "choices": [choice]}
            )

        @web.middleware
        async def check_key(request, handler):
            key = os.environ.get(self.api_key_var) if self.api_key_var else None
            if key and request.headers.get("Authorization") != f"Bearer {key}":
                self.unauthorized += 1
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[check_key])
        app.router.add_get("/v1/models", models)
        app.router.add_post("/inference/v1/generate", generate)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()
