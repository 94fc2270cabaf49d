"""Every place primejax touches vLLM beyond its command line starts in this module.

Three public extension points; the only patches are in two helper modules beside this one, each pinned by its
own test: `vllm_cpu_moe` (wraps a CPU MoE layer's kernel setup so reloads re-prepack its experts) and
`routed_capture` (CPU routed-expert return, installed by the plugin hook only when
`PRIMEJAX_ROUTED_EXPERTS_CAPTURE=1`).
- `PrimejaxWeightTransferEngine` (the collective transport's receiver, transports/weights/collective/receiver.py),
  a `vllm.distributed.weight_transfer` engine registered in vLLM's own engine registry by
  `register_transfer_engine` (entry point `vllm.general_plugins: primejax`, run in every vLLM process) and selected with `--weight-transfer-config '{"backend": "primejax"}'`: the collective weight
  update (docs/weight_transfer.md). vLLM's stock engines need CUDA; this one runs the same engine lifecycle
  over gloo on CPU (and NCCL on GPU), with timeouts.
- `PrimejaxWorkerExtension` (passed as `--worker-extension-cls`) is mixed into each vLLM worker and adds
  the in-place load that `collective_rpc("primejax_load_weights", ...)` runs on every worker.
- `PrimejaxEndpointPlugin` (entry point `vllm.endpoint_plugins: primejax`, enabled with
  `VLLM_PLUGINS=primejax`) attaches `primejax.inference.routes` to vLLM's own FastAPI app and hands those
  routes an `AdminEngine` built on the public `EngineClient` (pause/resume, collective RPC, prefix cache).

Used with vLLM 0.31 (vllm-cpu); `tests/inference/test_vllm_ext.py` pins the assumptions. Both weight-load paths
first call `primejax.inference.vllm_cpu_moe.install_cpu_moe_repack` (a helper module beside this one), which
makes vllm-cpu's reload re-prepack MoE expert weights.
"""

from __future__ import annotations

import logging
import os
import time
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primejax.inference.admin_auth import TOKEN_ENV
from primejax.inference.vllm_cpu_moe import install_cpu_moe_repack

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.datastructures import State

logger = logging.getLogger("primejax.inference")

WORKER_EXTENSION = "primejax.inference.vllm_ext.PrimejaxWorkerExtension"
PLUGIN_NAME = "primejax"
_LOAD_METHOD = "primejax_load_weights"
_DIGEST_METHOD = "primejax_weights_digest"
_READ_METHOD = "primejax_read_params"
# Most bytes one /weights_read answer carries (base64 in JSON): a layer or two of a small model, not a checkpoint.
READ_LIMIT_BYTES = 256 * 2**20
TRANSFER_BACKEND = "primejax"


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
        reload = getattr(self, "reload_weights", None)
        if reload is None:  # tpu-inference's TPUWorker: its weight sync is in-process JAX state, not a path
            raise NotImplementedError(
                f"{type(self).__name__} has no reload_weights: in-place weight updates are not implemented "
                "for this vLLM backend (vLLM TPU); see docs/tpu.md"
            )
        install_cpu_moe_repack(self.model_runner.get_model())  # type: ignore[attr-defined]
        load_config = getattr(self.model_runner, "load_config", None)  # type: ignore[attr-defined]
        if getattr(load_config, "load_format", None) == "dummy":
            # Started with random weights (`--load-format dummy`, e.g. to start fast and take the trainer's first
            # broadcast): vLLM's reload reads through the start-up loader, which has no files, so read them here.
            reload(weights_iterator=_safetensors(weight_dir))
        else:
            reload(weights_path=weight_dir)
        _refresh_cpu_lm_head_gemm(self.model_runner.get_model())  # type: ignore[attr-defined]
        return time.perf_counter() - t0

    def primejax_weights_digest(self) -> dict[str, str]:
        """sha256 of every parameter this worker serves, by vLLM's parameter name (its own fused layout): two
        servers, or one server after two update paths, serve the same weights iff these are equal."""
        return weights_digest(self.model_runner.get_model())  # type: ignore[attr-defined]

    def primejax_read_params(self, prefixes: list[str]) -> dict[str, dict]:
        """The live parameters whose names start with one of `prefixes`, as served (vLLM's names, fused layout,
        kernel dtype: an FP8 server's e4m3 weights and fp32 scales): {name: {dtype, shape, data}}."""
        return read_params(self.model_runner.get_model(), prefixes)  # type: ignore[attr-defined]


def _safetensors(weight_dir: str) -> Any:
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in Path(weight_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {weight_dir}")
    return safetensors_weights_iterator(files, False)


def read_params(model: Any, prefixes: list[str], limit: int = READ_LIMIT_BYTES) -> dict[str, dict]:
    """Raw bytes of the matching parameters (host copies); ValueError past `limit` bytes in all."""
    out, total = {}, 0
    for name, p in model.named_parameters():
        if not any(name.startswith(x) for x in prefixes):
            continue
        total += p.numel() * p.element_size()  # before copying anything to the host
        if total > limit:
            raise ValueError(f"the parameters under {prefixes} hold over {limit} bytes; ask for fewer")
        out[name] = {
            "dtype": str(p.dtype).removeprefix("torch."),
            "shape": list(p.shape),
            "data": _host_bytes(p),
        }
    return out


def weights_digest(model: Any) -> dict[str, str]:
    """sha256 of each parameter's bytes (on the host), by name."""
    import hashlib

    return {name: hashlib.sha256(_host_bytes(p)).hexdigest() for name, p in model.named_parameters()}


def _host_bytes(p: Any) -> bytes:
    """A parameter's bytes in its logical (row-major) order, whatever its dtype, layout or device."""
    import torch

    return p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


class VllmAdminEngine:
    """`routes.AdminEngine` over vLLM's public `EngineClient`."""

    def __init__(self, engine_client: Any, models: Any = None):
        """`models`: vLLM's `OpenAIServingModels` (app.state.openai_serving_models), which resolves a request's
        `model` name to a LoRA adapter; needed by the adapter methods only."""
        self.client = engine_client
        self.models = models

    async def pause(self) -> None:
        # "keep": in-flight requests stay queued and continue after resume (none aborted).
        await self.client.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.client.resume_generation()

    async def load_weights(self, weight_dir: str) -> None:
        await self.client.collective_rpc(_LOAD_METHOD, args=(weight_dir,))

    async def weights_digest(self) -> list[dict[str, str]]:
        """Each worker's `primejax_weights_digest` (one per tensor-parallel rank)."""
        return list(await self.client.collective_rpc(_DIGEST_METHOD))

    async def read_params(self, prefixes: list[str]) -> list[dict[str, dict]]:
        """Each worker's `primejax_read_params` (one per tensor-parallel rank)."""
        return list(await self.client.collective_rpc(_READ_METHOD, args=(list(prefixes),)))

    async def reset_cache(self) -> None:
        # Running requests are preempted and recomputed, so no KV from the old weights is reused.
        ok = await self.client.reset_prefix_cache(reset_running_requests=True)
        if ok is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight load")

    async def check_health(self) -> None:
        await self.client.check_health()

    async def load_adapter(self, name: str, adapter_dir: str) -> None:
        """Load a PEFT adapter into the engine and make `name` resolve to it (vLLM's own load_lora_adapter,
        called in process: its HTTP route would need VLLM_ALLOW_RUNTIME_LORA_UPDATING and has no admin secret)."""
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        out = await self.models.load_lora_adapter(
            LoadLoRAAdapterRequest(lora_name=name, lora_path=adapter_dir, load_inplace=True)
        )
        if not isinstance(out, str):  # an ErrorResponse
            raise RuntimeError(getattr(getattr(out, "error", out), "message", str(out)))

    async def unload_adapter(self, name: str) -> None:
        """Forget `name` and free its slot in the engine (vLLM's unload only forgets the name)."""
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        request = self.models.lora_requests.get(name)
        if request is None:
            return
        out = await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
        if not isinstance(out, str):
            raise RuntimeError(getattr(getattr(out, "error", out), "message", str(out)))
        await self.client.remove_lora(request.lora_int_id)

    def adapter_in_use(self, name: str) -> bool:
        """Whether a request the engine has not finished samples with adapter `name` (V1 AsyncLLM's output
        processor holds one state per unfinished request, with its adapter's name). Unknown = in use."""
        states = getattr(getattr(self.client, "output_processor", None), "request_states", None)
        if not isinstance(states, dict):
            return True
        return any(getattr(s, "lora_name", None) == name for s in list(states.values()))

    async def transfer_weights(self, init_info: dict, update_info: dict) -> None:
        """One collective update through vLLM's weight-transfer engine protocol (all four engine-client calls)."""
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        await self.client.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
        await self.client.start_weight_update()
        await self.client.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        await self.client.finish_weight_update()


def _transfer_engine_cls() -> type:
    """Built on first use so that importing this module never imports vLLM. The engine is the collective
    transport's receiver (transports/weights/collective/receiver.py); the vllm-cpu fix-ups around its reload
    (MoE re-prepack, LM-head GEMM re-pack) are this module's."""
    global _ENGINE_CLS
    if _ENGINE_CLS is None:
        from primejax.transports.weights.collective.receiver import engine_class

        _ENGINE_CLS = engine_class(prepare=install_cpu_moe_repack, finalize=_refresh_cpu_lm_head_gemm)
    return _ENGINE_CLS


_ENGINE_CLS: type | None = None


def register_transfer_engine() -> None:
    """vLLM general plugin: put primejax's engine into vLLM's weight-transfer registry (idempotent); also
    installs the CPU routed-experts capture when the server returns routed experts (routed_capture.py)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from primejax.inference import routed_capture

    routed_capture.install()

    try:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, _transfer_engine_cls())
    except ValueError:  # already registered in this process (the plugin hook runs more than once)
        pass


def transfer_plugin_installed() -> bool:
    """Whether vLLM processes will find `register_transfer_engine` (primejax installed with its entry points)."""
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN_NAME for ep in entry_points(group="vllm.general_plugins"))


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
        from primejax.inference.transport_routes import admin_router

        router = admin_router()  # the admin routes and the registered weight transports' own
        app.include_router(router)
        protect(app, router)

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        from primejax.inference.routes import AdminState
        from primejax.transports.weights.validate import WeightDirValidator

        if engine_client is None:  # a render-only server has no engine to update
            return

        from primejax.inference.admin_auth import REQUIRE_STABLE_ENV, WEIGHTS_ROOT_ENV, new_token

        base_dir = _local_model_dir(str(args.model))
        token = os.environ.get(TOKEN_ENV)
        if not token:
            logger.warning("%s is not set: the admin routes answer 401 to every caller", TOKEN_ENV)
        validator = WeightDirValidator(base_dir)
        transfer = getattr(args, "weight_transfer_config", None)
        backend = (
            transfer.get("backend") if isinstance(transfer, dict) else getattr(transfer, "backend", None)
        )
        lora_rank = int(getattr(args, "max_lora_rank", 0) or 0) if getattr(args, "enable_lora", False) else 0
        state.primejax = AdminState(
            engine=VllmAdminEngine(engine_client, getattr(state, "openai_serving_models", None)),
            base_dir=base_dir,
            validate=validator,
            max_lora_rank=lora_rank,
            admin_token=token or new_token(),
            weights_root=os.environ.get(WEIGHTS_ROOT_ENV, ""),
            require_stable=os.environ.get(REQUIRE_STABLE_ENV) == "1",
            check_transfer=validator.check_update_info if backend == TRANSFER_BACKEND else None,
        )
        logger.info(
            "primejax admin routes ready (base model %s, loads from %s)",
            base_dir,
            state.primejax.weights_root or "anywhere",
        )
