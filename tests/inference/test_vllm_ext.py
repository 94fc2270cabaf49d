"""Pins the vLLM extension points primejax relies on (vllm_ext.py is the only module touching them).

If a vLLM upgrade breaks one of these, this file says which assumption moved; the end-to-end behaviour is
covered by test_server.py.
"""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points

import pytest

from primejax.inference import vllm_ext


def test_endpoint_plugin_is_registered_and_satisfies_vllms_protocol():
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin

    eps = {ep.name: ep for ep in entry_points(group="vllm.endpoint_plugins")}
    assert eps[vllm_ext.PLUGIN_NAME].value == "primejax.inference.vllm_ext:PrimejaxEndpointPlugin"
    assert isinstance(eps[vllm_ext.PLUGIN_NAME].load()(), EndpointPlugin)


def test_worker_extension_adds_only_new_names_and_worker_has_reload_weights():
    from vllm.v1.worker.gpu_worker import Worker

    ours = {n for n in vars(vllm_ext.PrimejaxWorkerExtension) if not n.startswith("__")}
    assert ours == {
        "primejax_load_weights",
        "primejax_weights_digest",
        "primejax_read_params",
    } and not ours & set(dir(Worker))
    assert "weights_path" in inspect.signature(Worker.reload_weights).parameters or inspect.signature(
        Worker.reload_weights
    ).parameters.keys() >= {"args", "kwargs"}


def test_engine_client_offers_what_the_admin_engine_calls():
    from vllm.engine.protocol import EngineClient

    params = inspect.signature(EngineClient.pause_generation).parameters
    assert "mode" in params and "clear_cache" in params
    assert "reset_running_requests" in inspect.signature(EngineClient.reset_prefix_cache).parameters
    for name in ("resume_generation", "collective_rpc", "check_health"):
        assert callable(getattr(EngineClient, name))


def test_cpu_gemm_redispatch_helper_exists():
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    assert list(inspect.signature(dispatch_cpu_unquantized_gemm).parameters) == ["layer", "remove_weight"]


def test_weight_transfer_engine_registers_in_vllms_registry_and_implements_its_protocol():
    """The collective path: general plugin entry point -> vLLM's engine registry -> the worker's engine methods."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.engine.protocol import EngineClient
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.v1.worker.gpu_worker import Worker

    eps = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert eps[vllm_ext.PLUGIN_NAME].value == "primejax.inference.vllm_ext:register_transfer_engine"
    vllm_ext.register_transfer_engine()
    vllm_ext.register_transfer_engine()  # idempotent: vLLM runs general plugins more than once per process
    engine_cls = WeightTransferEngineFactory._registry[vllm_ext.TRANSFER_BACKEND]()
    assert issubclass(engine_cls, WeightTransferEngine) and not inspect.isabstract(engine_cls)
    assert WeightTransferConfig(backend=vllm_ext.TRANSFER_BACKEND).backend == vllm_ext.TRANSFER_BACKEND
    for name in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ):
        assert callable(getattr(EngineClient, name)) and callable(getattr(Worker, name))
    assert callable(initialize_layerwise_reload) and callable(finalize_layerwise_reload)
    init = engine_cls.init_info_cls(
        master_address="127.0.0.1", master_port=1, group_id="g", rank_offset=1, world_size=2
    )
    assert init.backend == "gloo" and init.timeout_s > 0


def test_worker_without_reload_weights_refuses_the_load_with_a_pointer_to_the_docs(tmp_path):
    """vLLM TPU's worker has no reload_weights: the load must fail loudly, never leave stale weights serving."""

    class TpuLikeWorker(vllm_ext.PrimejaxWorkerExtension):
        pass

    with pytest.raises(NotImplementedError, match=r"TpuLikeWorker has no reload_weights.*docs/tpu\.md"):
        TpuLikeWorker().primejax_load_weights(str(tmp_path))


def test_lora_serving_api_the_adapter_methods_call():
    """VllmAdminEngine's adapter methods (transports/weights/adapters/dirs.py): vLLM's serving-models object loads, names and
    forgets adapters; the engine frees one by id; each unfinished request's state names its adapter."""
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState

    assert {"load_lora_adapter", "unload_lora_adapter"} <= set(dir(OpenAIServingModels))
    assert {"lora_name", "lora_path", "load_inplace"} <= set(LoadLoRAAdapterRequest.model_fields)
    assert "lora_name" in UnloadLoRAAdapterRequest.model_fields
    assert "lora_id" in inspect.signature(AsyncLLM.remove_lora).parameters
    assert "request_states" in inspect.getsource(OutputProcessor.__init__)
    assert "self.lora_name" in inspect.getsource(RequestState.__init__)
