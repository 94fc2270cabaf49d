"""The admin routes' engine (primejax.inference.routes.AdminEngine) for tests that build the routes app without
vLLM: every call recorded in order. Tests that need a failure or more of the engine subclass it."""

from __future__ import annotations


class RecordingEngine:
    def __init__(self):
        self.calls: list[tuple[str, ...]] = []

    async def pause(self):
        self.calls.append(("pause",))

    async def resume(self):
        self.calls.append(("resume",))

    async def load_weights(self, weight_dir):
        self.calls.append(("load", weight_dir))

    async def reset_cache(self):
        self.calls.append(("reset",))

    async def check_health(self):
        pass
