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
    assert ours == {"primejax_load_weights"} and not ours & set(dir(Worker))
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


def test_worker_without_reload_weights_refuses_the_load_with_a_pointer_to_the_docs(tmp_path):
    """vLLM TPU's worker has no reload_weights: the load must fail loudly, never leave stale weights serving."""

    class TpuLikeWorker(vllm_ext.PrimejaxWorkerExtension):
        pass

    with pytest.raises(NotImplementedError, match=r"TpuLikeWorker has no reload_weights.*docs/tpu\.md"):
        TpuLikeWorker().primejax_load_weights(str(tmp_path))
