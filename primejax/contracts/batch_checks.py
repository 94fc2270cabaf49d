"""Checks of a batch file that run before anything in it is trusted: the manifest's types, every array's
shape and dtype from its `.npy` header (before a byte of it is decompressed), and the values both sides
agree on (`check_values`: the orchestrator runs it before writing, the trainer after reading).

A hostile or damaged file gets a `BatchFormatError` naming the file and the field, never an AttributeError,
an IndexError or a 391 MB allocation for a 0.39 MB file.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from primejax.contracts.batch_fields import WEIGHT_STREAMS

#: How far above 0 a stored log-probability may round (fp32 log_softmax of a near-certain token).
LOGPROB_SLACK = 1e-3


class BatchFormatError(ValueError):
    """A batch file or sample that violates the contract. Names the file (if any) and the field."""

    def __init__(self, path: str | Path | None, field_name: str, message: str):
        self.path = None if path is None else str(path)
        self.field = field_name
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}field {field_name!r}: {message}")


MAX_MANIFEST_BYTES = 16 << 20
MAX_CELLS = 1 << 32  # rows * seq_len of one batch file
MAX_MOE_LAYERS = 1024  # bounds of a routed_experts array's trailing [moe_layers, top_k]
MAX_TOP_K = 256


def check_manifest(path: Path | None, manifest: Any) -> tuple[int, int]:
    """The (rows, seq_len) the manifest declares, after checking its structure."""
    if not isinstance(manifest, dict):
        raise BatchFormatError(path, "__manifest__", f"must be a JSON object, got {type(manifest).__name__}")
    for key in ("fields", "meta"):
        if not isinstance(manifest.get(key, {}), dict):
            raise BatchFormatError(path, key, f"must be a JSON object, got {type(manifest[key]).__name__}")
    for name, entry in manifest.get("fields", {}).items():
        if not isinstance(entry, dict):
            raise BatchFormatError(
                path, f"fields.{name}", f"must be a JSON object, got {type(entry).__name__}"
            )
    rows, seq_len = manifest.get("rows"), manifest.get("seq_len")
    for key, value in (("rows", rows), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise BatchFormatError(path, key, f"must be an integer > 0, got {value!r}")
    if rows * seq_len > MAX_CELLS:
        raise BatchFormatError(
            path, "rows", f"{rows} x {seq_len} tokens is more than a batch file may hold ({MAX_CELLS})"
        )
    envs = manifest.get("meta", {}).get("envs")
    if envs is not None and (not isinstance(envs, list) or not all(isinstance(e, str) for e in envs)):
        raise BatchFormatError(path, "meta.envs", f"must be a list of environment names, got {envs!r}")
    max_segments = manifest.get("meta", {}).get("max_segments")
    if max_segments is not None and (not isinstance(max_segments, int) or isinstance(max_segments, bool)):
        raise BatchFormatError(path, "meta.max_segments", f"must be an integer, got {max_segments!r}")
    return rows, seq_len


def check_headers(
    path: Path,
    zf: zipfile.ZipFile,
    expected: dict[str, tuple[np.dtype, tuple[int, ...]]],
) -> None:
    """Every member's dtype and shape from its `.npy` header, and its stored size, before loading any array."""
    members = {info.filename: info for info in zf.infolist()}
    for name, (dtype, shape) in expected.items():
        info = members.get(f"{name}.npy")
        if info is None:
            raise BatchFormatError(path, name, "missing")
        if info.compress_type != zipfile.ZIP_STORED:  # nothing is inflated: no decompression bomb
            raise BatchFormatError(path, name, "compressed (batch files are written uncompressed)")
        try:
            with zf.open(info) as f:
                version = np.lib.format.read_magic(f)
                read = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                got_shape, fortran, got_dtype = read(f)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise BatchFormatError(path, name, f"unreadable .npy header ({type(e).__name__}: {e})") from None
        if got_dtype.hasobject:
            raise BatchFormatError(path, name, "object arrays are not allowed")
        if dtype is not None and got_dtype != dtype:
            raise BatchFormatError(path, name, f"dtype {got_dtype}, expected {dtype}")
        if shape is not None and tuple(got_shape) != shape:
            raise BatchFormatError(
                path, name, f"shape {tuple(got_shape)}, expected {shape} (rows, seq_len, ...)"
            )
        n_bytes = int(np.prod(got_shape, dtype=np.int64)) * got_dtype.itemsize
        limit = MAX_MANIFEST_BYTES if shape is None else n_bytes + 4096
        if info.file_size > limit or (shape is None and n_bytes > MAX_MANIFEST_BYTES):
            raise BatchFormatError(
                path, name, f"{info.file_size} bytes stored, more than its header allows ({limit})"
            )


def routed_headers(
    path: Path, manifest: dict, shape: tuple[int, int], names: set[str]
) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The routing-replay arrays a file must hold (dtype, shape), from its manifest: {} for a batch without.

    The pair is all or nothing, in the manifest and in the file alike; the trailing [moe_layers, top_k] of
    `routed_experts` comes from the manifest, bounded, and check_headers then holds the .npy header to it.
    """
    fields = manifest.get("fields", {})
    declared = [n for n in ("routed_experts", "routed_mask") if n in fields]
    stored = [n for n in ("routed_experts", "routed_mask") if n in names]
    if not declared and not stored:
        return {}
    for name in ("routed_experts", "routed_mask"):
        if name not in declared:
            raise BatchFormatError(
                path, name, "missing from the manifest (routed_experts and routed_mask come together)"
            )
        if name not in stored:
            raise BatchFormatError(path, name, "missing (routed_experts and routed_mask come together)")
    dims = fields["routed_experts"].get("shape")
    ok = (
        isinstance(dims, list)
        and len(dims) == 4
        and all(isinstance(d, int) and not isinstance(d, bool) for d in dims)
        and tuple(dims[:2]) == shape
        and 0 < dims[2] <= MAX_MOE_LAYERS
        and 0 < dims[3] <= MAX_TOP_K
    )
    if not ok:
        raise BatchFormatError(
            path,
            "fields.routed_experts.shape",
            f"must be [{shape[0]}, {shape[1]}, moe_layers <= "
            f"{MAX_MOE_LAYERS}, top_k <= {MAX_TOP_K}], got {dims!r}",
        )
    return {"routed_experts": (np.dtype(np.uint8), tuple(dims)), "routed_mask": (np.dtype(np.bool_), shape)}


def segment_count(segment_ids: np.ndarray) -> int:
    """The largest number of samples in one row (computed from the data; a file's own claim is not trusted)."""
    return int(segment_ids.max()) if segment_ids.size else 0


def check_values(path: Path | None, b: Any, vocab_size: int | None, num_experts: int | None = None) -> None:
    """Values both sides of the batch contract agree on; raises BatchFormatError(path, field, message).

    `num_experts`: routed expert ids must lie below it (when the batch carries them)."""
    if b.rows == 0 or b.seq_len == 0:
        raise BatchFormatError(path, "tokens", f"no tokens (shape {b.tokens.shape})")
    real = b.segment_ids > 0
    if (b.segment_ids < 0).any():
        raise BatchFormatError(path, "segment_ids", "negative segment id")
    if (b.positions < 0).any():
        raise BatchFormatError(path, "positions", "negative position")
    if (b.tokens < 0).any() or (vocab_size is not None and (b.tokens >= vocab_size).any()):
        raise BatchFormatError(
            path, "tokens", f"token id outside [0, {vocab_size if vocab_size else 'vocab'})"
        )
    if (b.loss_mask & ~real).any():
        raise BatchFormatError(path, "loss_mask", "set on a padding token (segment 0)")
    _check_segments(path, b.segment_ids, b.positions)
    starts = real & (b.positions == 0)
    if (b.loss_mask & starts).any():
        raise BatchFormatError(path, "loss_mask", "set on the first token of a sample (it has no predictor)")
    for name in ("inference_logprobs", "advantages", "ref_logprobs", *WEIGHT_STREAMS):
        if not np.isfinite(getattr(b, name)).all():
            raise BatchFormatError(path, name, "non-finite value")
    # log-probabilities are <= 0; the slack absorbs a log_softmax rounding of probability 1 to a hair above 0
    for name in ("inference_logprobs", "ref_logprobs"):
        if (getattr(b, name) > LOGPROB_SLACK).any():
            raise BatchFormatError(path, name, f"a log-probability above 0 (max {getattr(b, name).max():g})")
    if not (b.temperatures[real] > 0).all() or not np.isfinite(b.temperatures[real]).all():
        raise BatchFormatError(path, "temperatures", "must be finite and > 0 on every real token")
    envs = b.meta.get("envs") or []
    if (b.env_ids < 0).any() or (envs and (b.env_ids >= len(envs)).any()):
        raise BatchFormatError(
            path, "env_ids", f"outside [0, {len(envs) or 'envs'}) (meta.envs lists {len(envs)})"
        )
    if (b.staleness < 0).any():
        raise BatchFormatError(path, "staleness", "negative staleness")
    if getattr(b, "routed_experts", None) is not None:
        _check_routed(path, b, real, starts, num_experts)


def _check_routed(path, b: Any, real: np.ndarray, starts: np.ndarray, num_experts: int | None) -> None:
    experts, mask = b.routed_experts, b.routed_mask
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.shape != b.tokens.shape:
        raise BatchFormatError(
            path,
            "routed_mask",
            f"must be bool {b.tokens.shape}, got "
            f"{getattr(mask, 'dtype', type(mask).__name__)} {getattr(mask, 'shape', '')}",
        )
    if experts.dtype != np.uint8 or experts.ndim != 4 or experts.shape[:2] != b.tokens.shape:
        raise BatchFormatError(
            path,
            "routed_experts",
            f"must be uint8 [{b.tokens.shape[0]}, {b.tokens.shape[1]}, moe_layers, "
            f"top_k], got {experts.dtype} {experts.shape}",
        )
    if (mask & ~real).any():
        raise BatchFormatError(path, "routed_mask", "set on a padding token (segment 0)")
    if (mask & starts).any():
        raise BatchFormatError(
            path, "routed_mask", "set on the first token of a sample (no position predicts it)"
        )
    chosen = experts[mask]  # [n, moe_layers, top_k]
    if num_experts is not None and chosen.size and int(chosen.max()) >= num_experts:
        raise BatchFormatError(
            path, "routed_experts", f"expert id {int(chosen.max())} >= num_experts {num_experts}"
        )
    if chosen.shape[-1] > 1 and (np.diff(np.sort(chosen, axis=-1), axis=-1) == 0).any():
        raise BatchFormatError(
            path, "routed_experts", "a token lists the same expert twice in one layer's top-k"
        )


def _check_segments(path: Path | None, seg: np.ndarray, pos: np.ndarray) -> None:
    """Within a row, sample k+1 follows sample k (ids 1, 2, ... contiguous, each one block) and its positions
    count 0, 1, 2, ... from its first token."""
    prev_seg = np.concatenate([np.zeros_like(seg[:, :1]), seg[:, :-1]], axis=1)
    prev_pos = np.concatenate([np.full_like(pos[:, :1], -1), pos[:, :-1]], axis=1)
    real = seg > 0
    new = real & (seg != prev_seg)
    if (new & (seg != prev_seg + 1)).any():  # after padding (0) only sample 1 may start: padding ends a row
        raise BatchFormatError(
            path,
            "segment_ids",
            "samples of a row must be numbered 1, 2, ... in order, each one block (padding only at the end)",
        )
    if (new & (pos != 0)).any():
        raise BatchFormatError(path, "positions", "a sample's positions must start at 0")
    if (real & ~new & (pos != prev_pos + 1)).any():
        raise BatchFormatError(path, "positions", "a sample's positions must count up by 1")
