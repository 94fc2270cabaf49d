"""The client side of the servers' admin routes (routes.py, transport_routes.py): weight updates and versions.

`ServerAdmin` sits between `ServerPool` (server_pool.py: retries, identity, down servers) and `InferenceClient`
(client.py: sampling), so `client.update_weights(...)` and co. are methods of the client. Admin calls go to
every server that is up and carry the run's admin secret; sampling requests never do. A server whose call to
every server (`post_admin`, `pause`, ...) failed for good is marked down, as a failed sampling request marks it;
`transfer_weights` and the one-server calls (`update_one`, `server_version`) leave that to their caller.

The servers' answers to weight updates steer sampling: each names the LoRA adapter it now serves the policy as
(none: the served model itself), and once all of them name one, requests ask for it (`adapter`); each also says
how long its load took (`last_load_seconds`, for the run's metrics).
"""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

from primejax.inference.server_pool import InferenceError, ServerPool, error_message


class ServerAdmin(ServerPool):
    """Admin calls to every server (`post_admin`, `update_weights`, `pause`, ...) and what their answers say."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # The LoRA adapter every server serves the current policy as (transports/weights/adapters/dirs.py):
        # requests name it as their `model`; "" = the served model itself. Learned from the servers' answers to
        # weight updates.
        self._adapter = ""
        self.last_load_seconds: dict[str, float] = {}  # each server's own load time of the last weight update

    @property
    def adapter(self) -> str:
        """The LoRA adapter requests are sent to ("" = the served model itself)."""
        return self._adapter

    async def _all(self, method: str, path: str, payload: dict | None = None) -> list[Any]:
        # Admin calls (and only these) carry the secret: generation may go to endpoints that are not ours.
        async def one(url: str) -> Any:
            try:
                return await self._request(method, url, path, payload, self._admin_headers)
            except InferenceError as e:
                if e.status is None or e.status >= 500:
                    self.mark_down(url, str(e)[:200])
                raise

        return list(await asyncio.gather(*(one(u) for u in self.up_urls)))

    async def update_weights(self, weight_dir: str, version: int) -> None:
        """Load `weight_dir` in place on every server and serve it as `version`."""
        # Absolute on the wire: a server on another host (or another cwd) must not resolve our relative path.
        await self.post_admin(
            "/update_weights", {"weight_dir": os.path.abspath(weight_dir), "version": int(version)}
        )

    async def transfer_weights(self, version: int, init_info: dict, update_info: dict) -> None:
        """Receive `version` collectively on every server (the trainer is sending); the workers of server i join
        as ranks 1 + i * workers_per_server + their own rank (a tensor-parallel server has several).

        Not retried: a round is one rendezvous with the trainer and cannot be joined twice.
        """

        async def one(i: int, url: str) -> Any:
            workers = int(init_info.get("workers_per_server", 1))
            body = {
                "version": int(version),
                "init_info": {**init_info, "rank_offset": 1 + i * workers},
                "update_info": update_info,
            }
            await self._ensure_identity(url)
            r = await self._http.post(
                url + "/transfer_weights",
                json=body,
                headers=self._admin_headers,
                timeout=float(init_info.get("timeout_s", 60.0)) + 120.0,
            )
            if r.status_code >= 400:
                raise InferenceError(
                    f"POST {url}/transfer_weights: {r.status_code} {error_message(r)}", r.status_code
                )
            return r.json()

        urls = self.up_urls
        answers = list(await asyncio.gather(*(one(i, u) for i, u in enumerate(urls))))
        self._note_loads(urls, answers)
        self._adopt(answers)

    async def post_admin(self, path: str, body: dict) -> list[Any]:
        """POST `body` to an admin route on every server (a transport's own, registry.Route) and return the
        answers; an update's answers are read as /update_weights' are (load seconds, the adapter served)."""
        urls = self.up_urls
        answers = await self._all("POST", path, body)
        self._note_loads(urls, answers)
        self._adopt(answers)
        return answers

    async def reload_weights(self) -> None:
        """Go back to the base model on every server (version 0)."""
        self._adopt(await self._all("POST", "/reload_weights"))

    async def update_one(self, url: str, weight_dir: str | None, version: int) -> None:
        """Put one server on `weight_dir` as `version` (None: back to the base model, version 0)."""
        if weight_dir is None:
            await self._request("POST", url, "/reload_weights", None, self._admin_headers)
        else:
            await self._request(
                "POST",
                url,
                "/update_weights",
                {"weight_dir": os.path.abspath(weight_dir), "version": int(version)},
                self._admin_headers,
            )

    async def pause(self) -> None:
        await self._all("POST", "/pause")

    async def resume(self) -> None:
        await self._all("POST", "/resume")

    async def weights_version(self) -> int:
        """The weight version every server has reached (the minimum over servers); where they all serve one
        version, requests follow them to its adapter (an orchestrator restarted next to live servers)."""
        answers = await self._all("GET", "/weights_version")
        if len({int(v["version"]) for v in answers}) == 1:
            self._adopt(answers)
        return min(int(v["version"]) for v in answers)

    async def server_version(self, url: str) -> int:
        return int(
            (await self._request("GET", url, "/weights_version", None, self._admin_headers))["version"]
        )

    def _note_loads(self, urls: list[str], answers: list[Any]) -> None:
        """Each server's own time to load the last update (`load_seconds` of its answer), for the run's metrics;
        an answer without a sane figure gives none."""
        loads = {}
        for url, a in zip(urls, answers, strict=False):
            s = a.get("load_seconds") if isinstance(a, dict) else None
            if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0:
                loads[url] = float(s)
        self.last_load_seconds = loads

    def _adopt(self, answers: list[Any]) -> None:
        """Follow the servers to the adapter they all serve now (answers of /update_weights & co.)."""
        names = {a.get("adapter") or "" for a in answers if isinstance(a, dict)}
        if len(names) == 1:
            self._adapter = names.pop()
