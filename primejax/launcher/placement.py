"""Where a run's processes go on one node: which GPUs the trainer and each inference server see, and how much of
a shared GPU each may take.

Three layouts (docs/gpu.md):
- **CPU node** (no NVIDIA GPU): nothing to place; every process sees the CPU.
- **Split**: the trainer and the servers on disjoint GPUs (`trainer.devices`, `inference.devices`, each process
  started with only its own visible). When neither is set on a node of N > 1 GPUs, the servers take the last
  `inference.replicas x inference.tensor_parallel_size` GPUs and the trainer the others.
- **Shared**: the trainer and one server on the same GPU(s): both lists equal, or neither set on a one-GPU node.
  Memory is split: JAX preallocates `trainer.memory_fraction` of the card (0 = 0.45 here) and vLLM takes
  `inference.gpu_memory_utilization` (0 = 0.45 here); their sum must leave room for both CUDA contexts. vLLM
  measures the card's free memory while it profiles, so the launcher starts the server first and the trainer only
  once the server is healthy (a trainer allocating during the profile would shrink vLLM's KV cache, or stop it).

The launcher resolves the layout once, before anything starts, and writes it into the children's configs; the
children apply what they are given (utils/devices.py), so a child started by hand with the same file lands on
the same GPUs. Device ids in the config count the GPUs the launcher sees (`trainer.devices="0"` under
`CUDA_VISIBLE_DEVICES=2,3` is GPU 2); the ids written for the children are the node's own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, replace

from primejax.config import Config
from primejax.inference.server import OWN_GPU_MEMORY_UTILIZATION as OWN_INFERENCE_FRACTION
from primejax.launcher.preflight import PreflightError
from primejax.utils.devices import check_layout, parse_devices
from primejax.utils.sections import replace_keys

SHARED_TRAINER_FRACTION = 0.45
SHARED_INFERENCE_FRACTION = 0.45
# Above this sum the two CUDA contexts, cuBLAS/cuDNN workspaces and NCCL buffers outside both pools no longer fit.
SHARED_MAX_TOTAL = 0.92


class PlacementError(ValueError):
    """A layout that cannot work; `key` names the setting to change."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


@dataclass(frozen=True)
class Placement:
    node_gpus: int  # NVIDIA GPUs this launcher may use (0 = CPU node)
    trainer_devices: str  # CUDA_VISIBLE_DEVICES for the trainer ('' = all)
    inference_devices: str  # ... for the servers, split evenly over the replicas
    shared: bool  # the trainer and the server on the same GPU(s)
    trainer_memory_fraction: float  # 0 = JAX's default (75%)
    inference_memory_fraction: float

    def describe(self) -> str:
        if not self.node_gpus:
            return "placement: CPU node"
        t = self.trainer_devices or ",".join(map(str, range(self.node_gpus)))
        if self.shared:
            return (
                f"placement: trainer and inference share GPU(s) {t}: JAX {self.trainer_memory_fraction:g}, "
                f"vLLM {self.inference_memory_fraction:g} of each (server starts first)"
            )
        jax_share = (
            f"{self.trainer_memory_fraction:g}" if self.trainer_memory_fraction else "0.75 (JAX default)"
        )
        return (
            f"placement: trainer on GPU(s) {t} (JAX {jax_share}); inference on GPU(s) "
            f"{self.inference_devices} (vLLM {self.inference_memory_fraction:g})"
        )


def node_gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """NVIDIA GPUs this process may use, without initializing CUDA: CUDA_VISIBLE_DEVICES when set, else the
    driver's list (/proc/driver/nvidia/gpus), else `nvidia-smi -L`; 0 on a CPU node."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def to_physical(ids: str, visible: str | None) -> str:
    """Device ids counted among the launcher's own GPUs ('0' = the first it sees) as the ids a child's
    CUDA_VISIBLE_DEVICES needs: entries of the launcher's CUDA_VISIBLE_DEVICES when it has one (a child's list
    is read against all of the node's GPUs, not against its parent's), else unchanged."""
    if not ids or visible is None:
        return ids
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(e.isdigit() for e in entries):
        raise PlacementError(
            "trainer.devices",
            f"CUDA_VISIBLE_DEVICES={visible!r} holds non-numeric ids: give the launcher numeric GPU ids",
        )
    return ",".join(entries[int(i)] for i in ids.split(","))


def plan(
    node_gpus: int,
    trainer_devices: str,
    inference_devices: str,
    *,
    inference_enabled: bool = True,
    replicas: int = 1,
    tensor_parallel: int = 1,
    trainer_memory_fraction: float = 0.0,
    inference_memory_fraction: float = 0.0,
    visible: str | None = None,
) -> Placement:
    """The layout for this node from the config's settings (see the module docstring); PlacementError names
    the key to change when the layout cannot work. Device ids in the settings count the GPUs this launcher
    sees; the placement's are the ids its children get (`visible`: the launcher's CUDA_VISIBLE_DEVICES)."""
    p = _plan(
        node_gpus,
        trainer_devices,
        inference_devices,
        inference_enabled,
        replicas,
        tensor_parallel,
        trainer_memory_fraction,
        inference_memory_fraction,
    )
    if not p.node_gpus or not inference_enabled:
        return p
    return replace(
        p,
        trainer_devices=to_physical(p.trainer_devices, visible),
        inference_devices=to_physical(p.inference_devices, visible),
    )


def place(cfg: Config) -> tuple[Config, Placement]:
    """This node's layout for the run's settings, written into the config the children get (and printed, on a
    GPU node); PreflightError names the key to change when it cannot work."""
    inf, tr = cfg.inference, cfg.trainer
    try:
        p = plan(
            node_gpu_count(),
            tr.devices,
            inf.devices,
            inference_enabled=inf.enabled,
            replicas=inf.replicas,
            tensor_parallel=inf.tensor_parallel_size,
            trainer_memory_fraction=tr.memory_fraction,
            inference_memory_fraction=inf.gpu_memory_utilization,
            visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
    except PlacementError as e:
        raise PreflightError(e.key, str(e).split(": ", 1)[1]) from None
    if not p.node_gpus:
        return cfg, p
    if p.shared and tr.broadcast.mode == "collective":
        raise PreflightError(
            "trainer.broadcast.mode",
            "collective needs the trainer and the server on different "
            "GPUs (NCCL cannot join two processes on one GPU): use filesystem on a shared GPU",
        )
    print(f"primejax: {p.describe()}", flush=True)
    changes: dict[str, object] = {
        "trainer.devices": p.trainer_devices,
        "inference.devices": p.inference_devices,
        "trainer.memory_fraction": p.trainer_memory_fraction,
        "inference.gpu_memory_utilization": p.inference_memory_fraction,
    }
    if tr.broadcast.workers_per_server == 1:  # every tensor-parallel worker of a server receives the update
        changes["trainer.broadcast.workers_per_server"] = inf.tensor_parallel_size
    return replace_keys(cfg, changes), p


def _plan(
    node_gpus: int,
    trainer_devices: str,
    inference_devices: str,
    inference_enabled: bool,
    replicas: int,
    tensor_parallel: int,
    trainer_memory_fraction: float,
    inference_memory_fraction: float,
) -> Placement:
    t = parse_devices(trainer_devices, "trainer.devices")
    i = parse_devices(inference_devices, "inference.devices")
    own_inf = inference_memory_fraction or OWN_INFERENCE_FRACTION
    if not inference_enabled or node_gpus == 0:
        return Placement(
            node_gpus, trainer_devices, inference_devices, False, trainer_memory_fraction, own_inf
        )
    for ids, key in ((t, "trainer.devices"), (i, "inference.devices")):
        if ids and max(ids) >= node_gpus:
            raise PlacementError(
                key, f"GPU {max(ids)} does not exist: this node has {node_gpus} (0..{node_gpus - 1})"
            )
    per_server = tensor_parallel
    if not t and not i:
        if node_gpus == 1:
            shared = True
            t = i = [0]
        else:
            wanted = replicas * per_server
            if wanted >= node_gpus:
                raise PlacementError(
                    "inference.devices",
                    f"{replicas} replica(s) x tensor parallel {per_server} take {wanted} of this node's "
                    f"{node_gpus} GPUs and leave none to the trainer: set trainer.devices and inference.devices",
                )
            i = list(range(node_gpus - wanted, node_gpus))
            t = list(range(node_gpus - wanted))
            shared = False
    else:
        try:  # the config's own rule (utils/devices.py): both named, sharing all their GPUs or none
            check_layout(trainer_devices, inference_devices)
        except ValueError as e:
            key, _, message = str(e).partition(": ")
            raise PlacementError(key, message) from None
        shared = set(t) == set(i)
    if shared:
        if replicas != 1 or len(i) != per_server:
            raise PlacementError(
                "inference.replicas",
                f"a GPU shared with the trainer serves one replica over all {len(i)} shared GPU(s) "
                f"(replicas {replicas}, tensor parallel {per_server})",
            )
        jax = trainer_memory_fraction or SHARED_TRAINER_FRACTION
        vllm = inference_memory_fraction or SHARED_INFERENCE_FRACTION
        if jax + vllm > SHARED_MAX_TOTAL:
            raise PlacementError(
                "inference.gpu_memory_utilization",
                f"{vllm:g} + trainer.memory_fraction {jax:g} = {jax + vllm:g} of a shared GPU: keep the sum <= "
                f"{SHARED_MAX_TOTAL} (both CUDA contexts and their workspaces live outside the two pools)",
            )
        ids = ",".join(map(str, t))
        return Placement(node_gpus, ids, ids, True, jax, vllm)
    if len(i) != replicas * per_server:
        raise PlacementError(
            "inference.devices",
            f"{len(i)} GPU(s) for {replicas} replica(s) x tensor parallel {per_server}: give exactly "
            f"{replicas * per_server}",
        )
    return Placement(
        node_gpus, ",".join(map(str, t)), ",".join(map(str, i)), False, trainer_memory_fraction, own_inf
    )
