"""Checks a weight directory before the server loads it, without touching the engine.

vLLM's in-place reload streams tensors into the live model one by one, so a bad directory found half-way
leaves a model that is part old, part new. Everything that can be checked from file headers is therefore
checked first, against the base model's own checkpoint: config.json parses, every safetensors header is
readable and consistent with its file size, and the tensor names and shapes equal the base model's.
Only the headers are read (a few KB per file), so this costs milliseconds even for multi-GB checkpoints.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from primejax.contracts.rundir import parse_step

# A header bigger than this is corrupt, not large (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000

# Checkpoints of tied models sometimes carry the lm_head copy; the engine ignores it when embeddings are tied.
_TIED_OPTIONAL = "lm_head.weight"


class WeightDirError(ValueError):
    """A weight directory that must not be loaded; the message says why (shown to the HTTP caller)."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one .safetensors header; check every tensor's byte range lies inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise WeightDirError(f"{path.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw_len)
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise WeightDirError(f"{path.name}: header length {n} does not fit the {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightDirError(f"{path.name}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise WeightDirError(f"{path.name}: safetensors header is not a JSON object")
    data_bytes = size - 8 - n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = (
                meta["dtype"],
                tuple(int(d) for d in meta["shape"]),
                meta["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            raise WeightDirError(f"{path.name}: malformed header entry for {name!r}") from None
        if not 0 <= start <= end <= data_bytes:
            raise WeightDirError(f"{path.name}: tensor {name!r} lies outside the file (truncated?)")
        out[name] = TensorInfo(dtype, shape)
    return out


def read_checkpoint_tensors(model_dir: str | Path) -> dict[str, TensorInfo]:
    """Tensor names -> (dtype, shape) over all .safetensors files of a directory (headers only)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise WeightDirError(f"{d}: not a directory")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightDirError(f"{d}: no .safetensors files")
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_safetensors_header(f).items():
            if name in tensors:
                raise WeightDirError(f"{d}: tensor {name!r} appears in more than one file")
            tensors[name] = info
    return tensors


def _read_config(d: Path) -> dict:
    path = d / "config.json"
    if not path.is_file():
        raise WeightDirError(f"{d}: no config.json")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightDirError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise WeightDirError(f"{path}: not a JSON object")
    return cfg


def _is_tied(cfg: dict) -> bool:
    # Qwen3/Llama default to untied when the key is absent; nested text configs are not used by our families.
    return bool(cfg.get("tie_word_embeddings", False))


def validate_weight_dir(weight_dir: str | Path, reference: dict[str, TensorInfo], tied: bool) -> None:
    """Raise WeightDirError unless `weight_dir` holds exactly the reference model's tensors, by name and shape.

    dtypes may differ (a bf16 export of an fp32 base is fine: the engine casts on load).
    """
    d = Path(weight_dir)
    if not d.exists():
        raise WeightDirError(f"{d}: does not exist")
    _read_config(d)
    tensors = read_checkpoint_tensors(d)
    expected = set(reference)
    got = set(tensors)
    if tied:
        got.discard(_TIED_OPTIONAL)
        expected.discard(_TIED_OPTIONAL)
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise WeightDirError(
            f"{d}: tensor names differ from the served model (missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''})"
        )
    for name in sorted(expected):
        if tensors[name].shape != reference[name].shape:
            raise WeightDirError(
                f"{d}: {name} has shape {list(tensors[name].shape)}, the served model has {list(reference[name].shape)}"
            )


class WeightDirValidator:
    """Validates candidate weight dirs against a base model directory (read once)."""

    def __init__(self, base_model_dir: str | Path):
        self.base_model_dir = Path(base_model_dir)
        self.reference = read_checkpoint_tensors(self.base_model_dir)
        self.tied = _is_tied(_read_config(self.base_model_dir))

    def __call__(self, weight_dir: str | Path) -> None:
        validate_weight_dir(weight_dir, self.reference, self.tied)

    def check_update_info(self, update_info: dict) -> None:
        """A collective update must carry exactly the served model's tensors, by name and shape, each in a dtype
        the wire carries (checked here, before the server pauses: a bad one would fail mid-round)."""
        from primejax.transports.weights.collective.lanes import pieces_of
        from primejax.transports.weights.collective.meta import metas_from_update_info

        metas = metas_from_update_info(update_info)  # ValueError: lengths, dtype names, non-integer dims
        pieces_of(update_info, metas)  # ValueError: pieces that miss or overlap rows
        for meta in metas:
            if any(d < 0 for d in meta.shape):
                raise WeightDirError(f"{meta.name}: negative dimension in {list(meta.shape)}")
        names, shapes = update_info["names"], update_info["shapes"]
        if not isinstance(names, list) or not isinstance(shapes, list):
            raise WeightDirError("'names' and 'shapes' must be lists of equal length")
        got = {meta.name: meta.shape for meta in metas}
        expected, seen = set(self.reference), set(got)
        if self.tied:
            expected.discard(_TIED_OPTIONAL)
            seen.discard(_TIED_OPTIONAL)
        if len(got) != len(names) or expected != seen:
            missing, unexpected = sorted(expected - seen), sorted(seen - expected)
            raise WeightDirError(
                f"tensor names differ from the served model (missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}, {len(names) - len(got)} duplicated)"
            )
        for name in sorted(seen):
            if got[name] != self.reference[name].shape:
                raise WeightDirError(
                    f"{name} has shape {list(got[name])}, the served model has "
                    f"{list(self.reference[name].shape)}"
                )


def version_from_dir(weight_dir: str | Path) -> int | None:
    """The step number of a `.../step_N` directory, or None for any other name."""
    return parse_step(weight_dir)


def check_stable(weight_dir: str | Path, required: bool) -> None:
    """A directory with a STABLE manifest must match it file by file (sizes and sha256s); with `required`,
    one without a manifest (an incomplete or hand-made broadcast) is refused too."""
    from primejax.transports.weights.filesystem.broadcast import STABLE, BroadcastError, verify_broadcast

    d = Path(weight_dir)
    if not (d / STABLE).is_file():
        if required:
            raise WeightDirError(f"{d}: no {STABLE} manifest (only complete broadcasts load on this server)")
        return
    try:
        verify_broadcast(d, check_hashes=True)
    except (BroadcastError, KeyError, TypeError, AttributeError) as e:
        raise WeightDirError(f"{d}: does not match its {STABLE} manifest ({e})") from None
