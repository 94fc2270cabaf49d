"""A GPU node's layout: which accelerators each process sees, and how much of them JAX may take.

On one host the trainer and the inference server split the GPUs (`trainer.devices`, `inference.devices`,
CUDA_VISIBLE_DEVICES-style id lists). Each child is started with only its own GPUs visible, so the trainer's
JAX cannot create a context on, let alone allocate memory on, the server's GPUs: the isolation comes from
the driver, not from JAX settings. On its own GPUs JAX preallocates 75% of each card by default (fastest);
`trainer.memory_fraction` bounds that when something else shares the trainer's cards, and 0 keeps the
default. Nothing here imports JAX: the variables must be set before JAX initializes its backends.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from primejax.utils.sections import ConfigError


def parse_devices(spec: str, key: str) -> list[int]:
    """'0,1' -> [0, 1]; '' -> [] (all devices). One clear line naming `key` for anything else."""
    if not spec.strip():
        return []
    try:
        ids = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"{key}: expected comma-separated device ids like '0,1', got {spec!r}") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{key}: device ids must be distinct and >= 0, got {spec!r}")
    return ids


def check_layout(trainer_devices: str, inference_devices: str, inference_enabled: bool = True) -> None:
    """The trainer and a launched server must either both name their GPUs, or neither (the launcher then places
    them: primejax/launcher/placement.py); named, they share all of them or none.

    One named and the other not would leave the unnamed process seeing every GPU, the other's included (a
    trainer preallocating 75% of the server's card); equal lists are one GPU set shared, its memory split.
    """
    t = parse_devices(trainer_devices, "trainer.devices")
    i = parse_devices(inference_devices, "inference.devices")
    if not inference_enabled:
        return
    if bool(t) != bool(i):
        named, other = (
            ("trainer.devices", "inference.devices") if t else ("inference.devices", "trainer.devices")
        )
        raise ValueError(
            f"{other}: must be set too when {named} is (each process must see only its own GPUs)"
        )
    if set(t) & set(i) and set(t) != set(i):
        raise ValueError(
            f"trainer.devices: {sorted(set(t) & set(i))} also in inference.devices: the two share all their GPUs "
            "or none"
        )


def accelerator_env(
    devices: str, memory_fraction: float = 0.0, base: Mapping[str, str] | None = None
) -> dict:
    """Environment variables that give a child process only `devices`, with JAX's allocation bounded.

    `memory_fraction` > 0 sets XLA_PYTHON_CLIENT_MEM_FRACTION (JAX then preallocates that share of each
    visible card); a value already in `base` (the user's environment) wins over both defaults.
    """
    base = {} if base is None else base
    env: dict[str, str] = {}
    if devices and "CUDA_VISIBLE_DEVICES" not in base:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if memory_fraction > 0 and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in base:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{memory_fraction:g}"
    return env


PINNED_HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def local_gpu_count(devices: str, base: Mapping[str, str]) -> int:
    """GPUs this process will see: `devices` (trainer.devices), else CUDA_VISIBLE_DEVICES, else the NVIDIA
    driver's list (/proc/driver/nvidia/gpus); 0 when none of them says."""
    ids = devices or base.get("CUDA_VISIBLE_DEVICES", "")
    if ids:
        return len([d for d in ids.split(",") if d.strip()])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def pinned_host_env(state_bytes: float, total_devices: int, base: Mapping[str, str]) -> dict:
    """XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB for a run that keeps `state_bytes` of optimizer state in pinned host
    memory, sharded over `total_devices` GPUs: each device's share + 15% + 8 GiB (docs/memory.md).

    JAX's GPU client caps each device's pinned-host allocator (64 GiB unless told), below what a large offloaded
    model needs per device (92 GB for Qwen3-30B-A3B on 4 GPUs); far above the need, the allocator's doubling
    regions can ask for more than the host has (4 GPUs, a 460 GB cap each: docs/benchmarks.md). A value in `base`
    (the user's environment) wins; nothing without GPUs.
    """
    if PINNED_HOST_LIMIT_ENV in base or total_devices <= 0 or state_bytes <= 0:
        return {}
    share_gib = state_bytes / total_devices / 2**30
    return {PINNED_HOST_LIMIT_ENV: str(int(share_gib * 1.15) + 8)}


def host_memory_available(meminfo: str = "/proc/meminfo") -> int:
    """Bytes of host memory the kernel reports available (MemAvailable); 0 where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check_host_memory(state_bytes: float, local_devices: int, total_devices: int, available: int) -> None:
    """One line, before minutes of pinning, when this host cannot hold its devices' share of the offloaded state.

    Per process: where several trainer processes share a host (one GPU each), each checks only its own share."""
    if local_devices <= 0 or total_devices <= 0 or available <= 0:
        return
    need = state_bytes * local_devices / total_devices
    if need > available:
        raise ConfigError(
            "trainer.optim.offload",
            f"this host's {local_devices} GPU(s) need {need / 2**30:.0f} GiB of pinned host "
            f"memory for their share of the fp32 master weights and moments (12 B/param), and {available / 2**30:.0f}"
            " GiB are available: use more hosts or GPUs, or turn offload off (docs/memory.md)",
        )
