"""LoRA adapters served by version: names, the PEFT directory check, and which adapters may be unloaded.

With LoRA (`model.lora.rank > 0`, docs/lora.md) the trainer publishes `broadcasts/step_N` as a PEFT adapter
directory instead of full weights. The server keeps its frozen base model and loads each adapter next to the
ones already loaded under a versioned name (`adapter_name(N)`); requests choose it by sending that name as the
OpenAI `model`. Nothing is paused or reloaded: a request that started on the previous adapter finishes on it
(vLLM keys cached KV by adapter), so a sample is never part one policy, part another.

An adapter is unloaded once it is neither the served one nor the one served just before it (a client may have
built a request with that name a moment before it learned of the switch) and no request in the engine uses it.
`AdapterSet` is that bookkeeping alone (no engine), so it is tested without a server.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from pathlib import Path

from primejax.transports.weights.validate import WeightDirError, read_safetensors_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PREFIX = "policy-v"
#: The largest adapter scale (lora_alpha / r) a server accepts. PEFT's usual alphas give 0.5-4; an adapter with
#: lora_alpha 1e30 loaded fine and made the server sample uniformly.
MAX_LORA_SCALE = 1024.0
_FLOAT_DTYPES = {"F32", "F16", "BF16", "float32", "float16", "bfloat16"}
_PEFT_PREFIX = "base_model.model."


def adapter_name(version: int) -> str:
    """The served name of policy version `version`'s adapter (the same on every replica)."""
    return f"{ADAPTER_PREFIX}{int(version)}"


def is_adapter_dir(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def check_adapter_dir(directory: str | Path, max_rank: int, base: Mapping | None = None) -> dict:
    """Check a PEFT adapter directory from its config and safetensors header (nothing loaded); return the config.

    `max_rank`: the server's `--max-lora-rank` (0 = LoRA not enabled on this server); `base`: the served base
    model's tensors by name (`.shape`), which the adapter's shapes must fit (`check_adapter_tensors`)."""
    d = Path(directory)
    check_lora_enabled(str(d), max_rank)
    try:
        config = json.loads((d / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise WeightDirError(f"{d / ADAPTER_CONFIG}: unreadable ({e})") from None
    check_adapter_config(config, max_rank, str(d / ADAPTER_CONFIG))
    if not (d / ADAPTER_WEIGHTS).is_file():
        raise WeightDirError(f"{d}: no {ADAPTER_WEIGHTS}")
    header = read_safetensors_header(d / ADAPTER_WEIGHTS)
    check_adapter_names(header, str(d / ADAPTER_WEIGHTS))
    check_adapter_tensors(
        {n: (t.dtype, t.shape) for n, t in header.items()}, config["r"], base, str(d / ADAPTER_WEIGHTS)
    )
    return config


def check_lora_enabled(what: str, max_rank: int) -> None:
    if max_rank <= 0:
        raise WeightDirError(
            f"{what} is a LoRA adapter but this server was started without LoRA (--enable-lora)"
        )


def check_adapter_config(config: object, max_rank: int, where: str) -> None:
    """A PEFT LoRA config (`adapter_config.json`) whose rank is within the server's `max_rank`."""
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise WeightDirError(f"{where}: not a PEFT LoRA config (peft_type must be 'LORA')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank <= max_rank:
        raise WeightDirError(f"{where}: rank {rank!r} is not in 1..{max_rank} (the server's max LoRA rank)")
    alpha = config.get("lora_alpha", 8)  # PEFT's default
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, numbers.Real)
        or not math.isfinite(alpha)
        or not 0 < alpha <= MAX_LORA_SCALE * rank
    ):
        raise WeightDirError(
            f"{where}: lora_alpha {alpha!r} must be a finite number in (0, {MAX_LORA_SCALE:g} x r "
            f"= {MAX_LORA_SCALE * rank:g}] (the adapter scale is lora_alpha / r)"
        )


def check_adapter_tensors(
    tensors: Mapping[str, tuple[str, tuple]], rank: int, base: Mapping | None, where: str
) -> None:
    """Every tensor a float lora_A [r, in] or lora_B [out, r] of the config's rank, each module's A with its B;
    where the base model has the adapted weight ([out, in], PEFT's name without the `base_model.model.` prefix
    and the lora_A/lora_B part), `in` and `out` must be its dimensions."""
    modules: dict[str, dict[str, tuple]] = {}
    for name, (dtype, shape) in tensors.items():
        part = "A" if ".lora_A." in name else "B"
        module = name.replace(f".lora_{part}.", ".", 1)
        if (
            str(dtype) not in _FLOAT_DTYPES
            or len(shape) != 2
            or (shape[0] if part == "A" else shape[1]) != rank
        ):
            raise WeightDirError(
                f"{where}: {name}: {dtype} {list(shape)} is not a float lora_{part} "
                f"{'[r, in]' if part == 'A' else '[out, r]'} of rank {rank}"
            )
        modules.setdefault(module, {})[part] = tuple(shape)
    for module, parts in modules.items():
        if set(parts) != {"A", "B"}:
            raise WeightDirError(
                f"{where}: {module}: has lora_{'A' if 'A' in parts else 'B'} without its pair"
            )
        ref = None if base is None else base.get(module.removeprefix(_PEFT_PREFIX))
        if ref is None:
            continue  # a name the base stores otherwise (fused experts): only its rank is checked here
        out_in = tuple(ref.shape)
        if len(out_in) != 2 or (parts["B"][0], parts["A"][1]) != out_in:
            raise WeightDirError(
                f"{where}: {module}: adapter maps {parts['A'][1]} -> {parts['B'][0]} but the base "
                f"model's weight is {list(out_in)} [out, in]"
            )


def check_adapter_names(names: object, where: str) -> None:
    """Tensors named as PEFT's lora_A / lora_B weights only, at least one."""
    if not names or any(
        not isinstance(n, str) or (".lora_A." not in n and ".lora_B." not in n) for n in names
    ):
        raise WeightDirError(f"{where}: holds no tensors or tensors other than lora_A / lora_B")


class AdapterSet:
    """The adapters loaded on one server, oldest first, and which of them may go (see the module docstring)."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.current = ""  # "" = requests go to the base model (or to full weights loaded in place)
        self.previous = ""

    def serve(self, name: str) -> None:
        """`name` (loaded) is now the served adapter."""
        if name != self.current:
            self.previous, self.current = self.current, name
        if name in self.loaded:
            self.loaded.remove(name)
        self.loaded.append(name)

    def serve_base(self) -> None:
        """Requests go to the base model (or in-place full weights) from now on."""
        if self.current:
            self.previous, self.current = self.current, ""

    def retirable(self) -> list[str]:
        """Loaded adapters that may be unloaded once no request uses them."""
        keep = {self.current, self.previous}
        return [n for n in self.loaded if n not in keep]

    def unloaded(self, name: str) -> None:
        if name in self.loaded:
            self.loaded.remove(name)
        if self.previous == name:
            self.previous = ""


def vllm_max_lora_rank(rank: int) -> int:
    """vLLM's `--max-lora-rank` for adapters of rank `rank`: the smallest value vLLM accepts that holds it."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):  # vllm/config/lora.py MaxLoRARanks (0.31)
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank (512)")


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterSet",
    "adapter_name",
    "check_adapter_config",
    "check_adapter_dir",
    "check_adapter_names",
    "check_adapter_tensors",
    "check_lora_enabled",
    "is_adapter_dir",
    "vllm_max_lora_rank",
]
