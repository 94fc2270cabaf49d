"""The collective transport's receiver inside vLLM: a `vllm.distributed.weight_transfer` engine.

vLLM's worker creates it at model load and drives it through its own methods (`init_weight_transfer_engine` /
`start_weight_update` / `update_weights` / `finish_weight_update`); it receives one round of HF tensors with
`wire.Receiver` and loads them with vLLM's layerwise reload (an MoE layer's experts per projection, fused.py) (the lifecycle of vLLM's NCCL engine: start ->
load_weights per bucket -> finalize). vLLM's stock engines need CUDA; this one runs over gloo on CPU (and NCCL on
GPU), with timeouts. Registered by the vLLM plugin in `primejax/inference/vllm_ext.py`, which passes the
server's fix-ups around a reload (`prepare` before it starts, `finalize` after it ends).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from primejax.contracts.secret import read_token
from primejax.transports.weights.collective import wire
from primejax.transports.weights.collective.fused import ExpertLoader


def engine_class(prepare: Callable[[Any], None], finalize: Callable[[Any], None]) -> type:
    """The engine class (built here so that importing this module never imports vLLM or torch)."""
    from dataclasses import dataclass

    import torch
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    log = init_logger("vllm.primejax.transfer")  # under vllm's logger: the server's log shows it

    @dataclass(kw_only=True)
    class InitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        group_id: str
        rank_offset: int
        world_size: int
        timeout_s: float = 60.0
        bucket_bytes: int = wire.DEFAULT_BUCKET_BYTES
        backend: str = "gloo"
        senders: int = 1  # trainer processes, one lane each (primejax.transports.weights.collective.lanes)
        workers_per_server: int = 1
        fused_experts: bool = True  # MoE experts per projection into the fused parameters (fused.py)

    @dataclass(kw_only=True)
    class UpdateInfo(WeightTransferUpdateInfo):
        round_id: str
        names: list
        dtype_names: list
        shapes: list
        senders: int = 1
        pieces: list | None = None  # [tensor, sender, first row, end row]; None = whole tensors from sender 0
        wire_version: int = 1  # a round without it is refused (meta.check_version)
        stacks: list | None = None  # [first tensor, count] per stack (meta.py)

    class PrimejaxWeightTransferEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        """Receives one round of HF tensors from the primejax trainer (`wire.Receiver`) and loads
        them with vLLM's layerwise reload (the lifecycle of vLLM's NCCL engine: start -> load_weights per bucket
        -> finalize)."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.info: InitInfo | None = None
            self.receiver = wire.Receiver()
            self.reloading = False

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            # Recorded only; the receiver joins (or keeps) the trainer's group in the round itself.
            self.info = init_info

        def start_weight_update(self) -> None:
            prepare(self.model)
            initialize_layerwise_reload(self.model)
            self.reloading = True

        def update_weights(self, update_info: dict) -> None:
            # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only hosts.
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.current_accelerator() is not None:
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: UpdateInfo) -> None:
            info = self.info
            if info is None:
                raise RuntimeError("primejax weight transfer: init_weight_transfer_engine was not called")
            p = self.parallel_config
            rank = info.rank_offset + p.data_parallel_index * p.world_size + p.rank
            load: Any = self.model.load_weights
            if info.fused_experts:
                load = ExpertLoader(self.model, self.model.load_weights)
            try:
                self.receiver.receive(
                    vars(info),
                    vars(update_info),
                    rank,
                    self.device,
                    load,
                    read_token(),
                    before_ack=getattr(load, "check_done", None),
                )
                if isinstance(load, ExpertLoader) and load.fused_calls:
                    log.info(
                        "round %s: %d MoE expert projections loaded whole into the fused parameters",
                        update_info.round_id,
                        load.fused_calls,
                    )
            except BaseException:
                # Leave the layerwise-reload state (layers that got nothing get their previous tensors back)
                # so the model is usable by the next full load; the caller decides what the weights are now.
                self.finish_weight_update()
                raise

        def finish_weight_update(self) -> None:
            if self.reloading:
                self.reloading = False
                finalize_layerwise_reload(self.model, self.model_config)
                finalize(self.model)

        def shutdown(self) -> None:
            self.info = None

        @staticmethod
        def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
            # Abstract in vLLM < 0.28 (vllm_compat.py): primejax's trainer sends through primejax.transports.weights.
            raise NotImplementedError(
                "primejax's trainer sends weights with primejax.transports.weights.collective.sender"
            )

    return PrimejaxWeightTransferEngine
