"""The orchestrator -> trainer contract: training samples, packing, and the on-disk batch format.

Alignment convention (every per-token stream)
---------------------------------------------
All per-token streams of a `TrainingSample` have the length of `token_ids` and describe token t *as a target*:
`loss_mask[t]`, `inference_logprobs[t]`, `advantages[t]`, `ref_logprobs[t]` and the weight streams are about
predicting `token_ids[t]` from the prefix `token_ids[:t]` (the logits at position t - 1). The first token of a
sample has no predictor, so its `loss_mask` must be False. Prompt and environment tokens carry
`loss_mask = False` and `inference_logprobs = 0.0`.

Loss components and weight streams
----------------------------------
A token is a member of loss component c (rl, ce, ref_kl) when `loss_mask[t]` is True and the component's
weight `w_c[t]` is non-zero; the weight scales its per-token loss. So `loss_mask` is the union of every
trained token, and a weight of 0 removes a token from that component's mask and its token count. A sample
that ships *no* weight stream at all is a plain rl sample: rl weight 1.0 on every loss-mask token, ce and
ref_kl weight 0. A sample that ships any weight stream gets 0.0 for each stream it omits. Missing
advantages / ref_logprobs are 0.0 (a token with a non-zero ref_kl weight needs ref_logprobs).

Packing
-------
`pack_samples` places samples first-fit-decreasing into rows of `seq_len` tokens. Each sample keeps its own
segment id (1, 2, ... within a row; 0 = padding) and positions restarting at 0, so attention (causal within
a segment, never across) and the loss see exactly the per-sample computation. Rows are dealt to
`num_shards` data-parallel shards with balanced token counts; every shard gets the same number of rows
(empty padding rows if needed), rounded up to `pad_rows_to_multiple`. A sample longer than `seq_len` is an
error unless `truncate=True`, which cuts it to `seq_len` tokens (its tail is lost; the cut is counted in
`meta["num_truncated"]`).

On disk
-------
`rollouts/step_N/rank_R.npz`: one uncompressed `.npz` per data-parallel rank (loaded with
`allow_pickle=False`), written to a temp name and renamed, so its existence means it is complete. Besides the
arrays it holds `__manifest__`, a JSON document (as uint8) with the format version, each field's dtype, shape
and sha256, and the writer's metadata. `read_batch` checks all of it and raises `BatchFormatError` naming the
file and the field; nothing malformed reaches the jitted step.

Format versions
---------------
A reader accepts exactly its own `FORMAT_VERSION` and converts nothing: batch files live for a few steps of
one run, so a file of another version is a leftover of another primejax (a run resumed across an upgrade),
refused on the version before any field is looked at. Any change to what a file holds (an array of FIELDS,
the optional routed pair, a meta key the trainer reads, a stream's meaning) bumps the version and adds a line
here; tests/contracts/test_batch.py pins each version's arrays and meta keys.

- 1: tokens, positions, segment_ids, loss_mask, inference_logprobs, advantages, temperatures, ref_logprobs,
  the three weight streams; optional routed_experts + routed_mask.
- 2: + env_ids (int32, the token's environment, an index into meta["envs"]) and staleness (int32, trainer
  step - 1 - the sampling policy's version), which the rl loss corrections read per environment and staleness.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from primejax.contracts.batch_checks import (
    BatchFormatError,
    check_headers,
    check_manifest,
    check_values,
    routed_headers,
    segment_count,
)
from primejax.contracts.batch_fields import FIELDS, LOSS_COMPONENTS, OPTIONAL_STREAMS, WEIGHT_STREAMS
from primejax.contracts.rundir import RunDir, step_dirs
from primejax.utils.io import atomic_write_bytes

FORMAT_VERSION = 2  # see "Format versions" above
MANIFEST_KEY = "__manifest__"


@dataclass
class TrainingSample:
    """One (possibly multi-turn merged) token sequence with its per-token training signal."""

    token_ids: list[int]
    loss_mask: list[bool]
    inference_logprobs: list[float]
    advantages: list[float] | None = None  # None: no rl credit (opd / opsd / sft)
    temperature: float = 1.0
    ref_logprobs: list[float] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    policy_version: int = 0
    env_index: int = 0  # the sample's environment: its index in the batch's meta["envs"]
    # Routing replay: uint8 [len, moe_layers, top_k] per target token, and which tokens carry a recorded routing.
    routed_experts: np.ndarray | None = None
    routed_mask: list[bool] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def validate(self, index: int | None = None) -> None:
        """Raise BatchFormatError if a stream's length differs or the first token is trained."""
        where = None if index is None else f"sample {index}"
        n = len(self.token_ids)
        if n == 0:
            raise BatchFormatError(where, "token_ids", "empty sample")
        for name in ("loss_mask", "inference_logprobs", *OPTIONAL_STREAMS):
            stream = getattr(self, name)
            if stream is not None and len(stream) != n:
                raise BatchFormatError(where, name, f"length {len(stream)} != len(token_ids) {n}")
        if self.loss_mask[0]:
            raise BatchFormatError(
                where, "loss_mask", "the first token has no predictor and cannot be trained"
            )
        if not self.temperature > 0:
            raise BatchFormatError(where, "temperature", f"must be > 0, got {self.temperature}")
        if (self.routed_experts is None) != (self.routed_mask is None):
            raise BatchFormatError(where, "routed_experts", "routed_experts and routed_mask come together")
        if self.routed_experts is not None:
            e = self.routed_experts
            if not isinstance(e, np.ndarray) or e.dtype != np.uint8 or e.ndim != 3 or e.shape[0] != n:
                raise BatchFormatError(
                    where,
                    "routed_experts",
                    f"must be uint8 [{n}, moe_layers, top_k], got "
                    f"{getattr(e, 'dtype', type(e).__name__)} {getattr(e, 'shape', '')}",
                )
            if len(self.routed_mask) != n:
                raise BatchFormatError(
                    where, "routed_mask", f"length {len(self.routed_mask)} != len(token_ids) {n}"
                )


@dataclass
class PackedBatch:
    """[rows, seq_len] arrays of one data-parallel shard (see FIELDS for names and dtypes)."""

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    inference_logprobs: np.ndarray
    advantages: np.ndarray
    temperatures: np.ndarray
    ref_logprobs: np.ndarray
    rl_weights: np.ndarray
    ce_weights: np.ndarray
    ref_kl_weights: np.ndarray
    env_ids: np.ndarray
    staleness: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    routed_experts: np.ndarray | None = None  # uint8 [rows, seq_len, moe_layers, top_k] (routing replay only)
    routed_mask: np.ndarray | None = None  # bool [rows, seq_len]

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """(moe_layers, top_k) of the routed experts it carries, None without them."""
        return None if self.routed_experts is None else tuple(self.routed_experts.shape[2:])

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array in file order; the routed pair only when present."""
        out = {name: getattr(self, name) for name in FIELDS}
        if self.routed_experts is not None:
            out.update(routed_experts=self.routed_experts, routed_mask=self.routed_mask)
        return out

    @classmethod
    def empty(
        cls,
        rows: int,
        seq_len: int,
        meta: dict[str, Any] | None = None,
        routing_shape: tuple[int, int] | None = None,
    ) -> PackedBatch:
        """All-padding rows: segment 0, no loss, temperature 1 (and no recorded routing, when `routing_shape`)."""
        arrays = {name: np.zeros((rows, seq_len), dtype) for name, dtype in FIELDS.items()}
        arrays["temperatures"][:] = 1.0
        if routing_shape is not None:
            arrays["routed_experts"] = np.zeros((rows, seq_len, *routing_shape), np.uint8)
            arrays["routed_mask"] = np.zeros((rows, seq_len), np.bool_)
        return cls(**arrays, meta=dict(meta or {}))

    def pad_rows(self, rows: int) -> PackedBatch:
        """A copy with empty rows appended up to `rows` (no-op if already that many)."""
        if rows < self.rows:
            raise ValueError(f"cannot pad {self.rows} rows down to {rows}")
        if rows == self.rows:
            return self
        pad = PackedBatch.empty(rows - self.rows, self.seq_len, routing_shape=self.routing_shape)
        merged = {n: np.concatenate([a, getattr(pad, n)]) for n, a in self.arrays().items()}
        return PackedBatch(**merged, meta=dict(self.meta))


def batch_env_names(envs: Sequence[str]) -> tuple[str, ...]:
    """The names a batch's `env_ids` index: orchestrator.envs sorted (the orchestrator and trainer agree)."""
    return tuple(sorted(envs))


def _weights(sample: TrainingSample) -> dict[str, np.ndarray]:
    n = len(sample)
    if all(getattr(sample, w) is None for w in WEIGHT_STREAMS):
        # The plain-GRPO hot path: no stream shipped means rl on every trainable token.
        return {
            "rl_weights": np.ones(n, np.float32),
            "ce_weights": np.zeros(n, np.float32),
            "ref_kl_weights": np.zeros(n, np.float32),
        }
    return {
        w: np.zeros(n, np.float32)
        if getattr(sample, w) is None
        else np.asarray(getattr(sample, w), np.float32)
        for w in WEIGHT_STREAMS
    }


def _routing_shape(samples: Sequence[TrainingSample]) -> tuple[int, int] | None:
    """The (moe_layers, top_k) every sample's routed experts share; None when no sample has them.

    All or none: a batch mixes no replayed with free-routing samples (the orchestrator records every
    completion when routing replay is on)."""
    shapes = {None if s.routed_experts is None else tuple(s.routed_experts.shape[1:]) for s in samples}
    if len(shapes) > 1:
        raise BatchFormatError(
            None,
            "routed_experts",
            f"samples disagree on [moe_layers, top_k] (or on having "
            f"routed experts at all): {sorted(map(str, shapes))}",
        )
    return shapes.pop() if shapes else None


def _first_fit_decreasing(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Sample indices per row: longest first, each into the first row with room (ties keep input order)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    return rows


def pack_samples(
    samples: Sequence[TrainingSample],
    seq_len: int,
    num_shards: int = 1,
    pad_rows_to_multiple: int = 1,
    truncate: bool = False,
    step: int = 0,
    envs: Sequence[str] = (),
) -> list[PackedBatch]:
    """Pack samples into rows of `seq_len`, one PackedBatch per data-parallel shard (see module docstring).

    `step`: the trainer step the batch is for (staleness = step - 1 - policy version; 0 = not known, every
    token on-policy); `envs`: the names `env_index` indexes, recorded as meta["envs"]."""
    if seq_len <= 0 or num_shards <= 0 or pad_rows_to_multiple <= 0:
        raise ValueError("seq_len, num_shards and pad_rows_to_multiple must be positive")
    num_truncated = 0
    lengths = []
    for i, s in enumerate(samples):
        s.validate(i)
        if len(s) > seq_len:
            if not truncate:
                raise BatchFormatError(
                    f"sample {i}",
                    "token_ids",
                    f"length {len(s)} exceeds seq_len {seq_len} (pass truncate=True to cut it)",
                )
            num_truncated += 1
        lengths.append(min(len(s), seq_len))

    row_members = _first_fit_decreasing(lengths, seq_len)
    # Deal rows to shards snake-wise in decreasing fill, so shards get similar token counts.
    fill = [sum(lengths[i] for i in members) for members in row_members]
    by_fill = sorted(range(len(row_members)), key=lambda r: (-fill[r], r))
    shard_rows: list[list[int]] = [[] for _ in range(num_shards)]
    for k, r in enumerate(by_fill):
        lap, pos = divmod(k, num_shards)
        shard_rows[pos if lap % 2 == 0 else num_shards - 1 - pos].append(r)
    per_shard = max(1, max(len(rs) for rs in shard_rows))
    per_shard = -(-per_shard // pad_rows_to_multiple) * pad_rows_to_multiple

    # One bound for every shard: a custom loss compiles per-row segment loops of this size on every rank.
    max_segments = max((len(m) for m in row_members), default=0)
    routing = _routing_shape(samples)
    out = []
    for shard, rows in enumerate(shard_rows):
        batch = PackedBatch.empty(per_shard, seq_len, routing_shape=routing)
        versions: list[int] = []
        for row, r in enumerate(rows):
            offset = 0
            for seg, i in enumerate(row_members[r], start=1):
                s, n = samples[i], lengths[i]
                sl = slice(offset, offset + n)
                batch.tokens[row, sl] = np.asarray(s.token_ids[:n], np.int32)
                batch.positions[row, sl] = np.arange(n, dtype=np.int32)
                batch.segment_ids[row, sl] = seg
                batch.loss_mask[row, sl] = np.asarray(s.loss_mask[:n], bool)
                batch.inference_logprobs[row, sl] = np.asarray(s.inference_logprobs[:n], np.float32)
                batch.temperatures[row, sl] = s.temperature
                if s.advantages is not None:
                    batch.advantages[row, sl] = np.asarray(s.advantages[:n], np.float32)
                if s.ref_logprobs is not None:
                    batch.ref_logprobs[row, sl] = np.asarray(s.ref_logprobs[:n], np.float32)
                for w, values in _weights(s).items():
                    getattr(batch, w)[row, sl] = values[:n]
                batch.env_ids[row, sl] = s.env_index
                batch.staleness[row, sl] = max(0, step - 1 - s.policy_version) if step else 0
                if routing is not None:
                    batch.routed_experts[row, sl] = s.routed_experts[:n]
                    batch.routed_mask[row, sl] = np.asarray(s.routed_mask[:n], bool)
                versions.append(s.policy_version)
                offset += n
        present = sorted(
            {
                name
                for i in (m for r in rows for m in row_members[r])
                for name in OPTIONAL_STREAMS
                if getattr(samples[i], name) is not None
            }
        )
        batch.meta = {
            "shard": shard,
            "num_shards": num_shards,
            "num_samples": len(versions),
            "num_tokens": int((batch.segment_ids > 0).sum()),
            "num_loss_tokens": int(batch.loss_mask.sum()),
            "num_truncated": num_truncated,
            "max_segments": max_segments,
            "min_policy_version": min(versions, default=0),
            "max_policy_version": max(versions, default=0),
            "present_streams": present,
            "envs": list(envs),
        }
        out.append(batch)
    return out


# ----------------------------------------------------------------------------------------------- files


def step_dir(run_dir: str | Path, step: int) -> Path:
    return RunDir(run_dir).rollouts(step)


def batch_path(run_dir: str | Path, step: int, rank: int) -> Path:
    return step_dir(run_dir, step) / f"rank_{rank}.npz"


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def write_batch(
    step_dir: str | Path, rank: int, batch: PackedBatch, meta: dict[str, Any] | None = None
) -> Path:
    """Write `batch` as `<step_dir>/rank_<rank>.npz` atomically. `meta` (JSON-serializable) joins batch.meta."""
    arrays = batch.arrays()
    for name, dtype in FIELDS.items():
        if arrays[name].dtype != dtype or arrays[name].shape != arrays["tokens"].shape:
            raise BatchFormatError(
                None,
                name,
                f"expected {dtype} {arrays['tokens'].shape}, got {arrays[name].dtype} {arrays[name].shape}",
            )
    if (batch.routed_experts is None) != (batch.routed_mask is None):
        raise BatchFormatError(None, "routed_experts", "routed_experts and routed_mask come together")
    path = Path(step_dir) / f"rank_{rank}.npz"
    # The checks the trainer runs on reading, run before writing: a bad value fails here, naming its step.
    meta = {**batch.meta, **(meta or {})}
    check_values(path, batch, None, num_experts=meta.get("num_experts"))
    manifest = {
        "format_version": FORMAT_VERSION,
        "rows": batch.rows,
        "seq_len": batch.seq_len,
        "fields": {
            n: {"dtype": a.dtype.str, "shape": list(a.shape), "sha256": _sha256(a)} for n, a in arrays.items()
        },
        "meta": meta,
    }
    buf = io.BytesIO()
    manifest_bytes = np.frombuffer(json.dumps(manifest).encode("utf-8"), np.uint8)
    np.savez(buf, **arrays, **{MANIFEST_KEY: manifest_bytes})
    atomic_write_bytes(path, buf.getvalue())
    return path


def read_batch(
    path: str | Path,
    vocab_size: int | None = None,
    num_experts: int | None = None,
    routing_shape: tuple[int, int] | None = None,
) -> PackedBatch:
    """Load and validate a batch file; raises BatchFormatError naming the file and the field.

    `num_experts` / `routing_shape` (moe_layers, top_k): the reader's model, which the routed experts of a
    routing-replay batch must fit (a dense reader passes neither and such a batch is refused).
    """
    path = Path(path)
    try:
        data = np.load(path, allow_pickle=False)
        names = set(data.files)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise BatchFormatError(
            path, "<file>", f"unreadable or truncated npz ({type(e).__name__}: {e})"
        ) from None
    with data:
        if MANIFEST_KEY not in names:
            raise BatchFormatError(path, MANIFEST_KEY, "missing (not a primejax batch file)")
        check_headers(path, data.zip, {MANIFEST_KEY: (np.dtype(np.uint8), None)})
        try:
            manifest = json.loads(_load(data, path, MANIFEST_KEY).tobytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BatchFormatError(path, MANIFEST_KEY, f"not valid JSON ({e})") from None
        except RecursionError:  # json's decoder recurses per nesting level
            raise BatchFormatError(path, MANIFEST_KEY, "nested too deeply to be a manifest") from None
        if not isinstance(manifest, dict):
            raise BatchFormatError(
                path, MANIFEST_KEY, f"must be a JSON object, got {type(manifest).__name__}"
            )
        version = manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise BatchFormatError(
                path,
                "format_version",
                f"expected {FORMAT_VERSION}, got {version!r} (written by "
                "another primejax version; batch files are not converted)",
            )
        shape = check_manifest(path, manifest)
        # Shapes and dtypes from the .npy headers first: nothing is decompressed for a file that lies.
        headers = {name: (dtype, shape) for name, dtype in FIELDS.items()}
        headers.update(routed_headers(path, manifest, shape, names))
        check_headers(path, data.zip, headers)
        arrays = {}
        for name in headers:
            a = _load(data, path, name)
            expected = manifest["fields"].get(name, {}).get("sha256")
            if expected != _sha256(a):
                raise BatchFormatError(path, name, "sha256 mismatch (corrupted file)")
            arrays[name] = a
    batch = PackedBatch(**arrays, meta=dict(manifest.get("meta", {})))
    if batch.routing_shape is not None and batch.routing_shape != routing_shape:
        raise BatchFormatError(
            path,
            "routed_experts",
            f"[moe_layers, top_k] = {list(batch.routing_shape)}, the "
            f"model routes {'no experts (dense)' if routing_shape is None else list(routing_shape)}",
        )
    check_values(path, batch, vocab_size, num_experts=num_experts)
    # Computed, never trusted below the data: an understated count made a custom loss skip whole samples. A
    # larger claim (every rank's files carry the largest count over all ranks, so all compile one step) is
    # kept, up to one sample per token.
    claimed = batch.meta.get("max_segments") or 0
    if claimed > batch.seq_len:
        raise BatchFormatError(
            path, "meta.max_segments", f"{claimed} is more than a row of {batch.seq_len} tokens can hold"
        )
    batch.meta["max_segments"] = max(claimed, segment_count(batch.segment_ids))
    return batch


def _load(data: Any, path: Path, name: str) -> np.ndarray:
    try:
        return data[name]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise BatchFormatError(path, name, f"unreadable ({type(e).__name__}: {e})") from None


def prune_rollouts(run_dir: str | Path, rank: int, through_step: int) -> list[int]:
    """Delete this rank's batch files of steps <= `through_step`, and each such step directory once empty.

    Every rank deletes its own file (the rollouts directory need not be shared); whichever rank removes the
    last file removes the directory. Temp directories of unfinished writes are not touched. Returns the
    steps whose directory is gone.
    """
    removed = []
    for step, p in step_dirs(RunDir(run_dir).rollouts()):
        if step > through_step:
            break
        (p / f"rank_{rank}.npz").unlink(missing_ok=True)
        try:
            p.rmdir()
            removed.append(step)
        except OSError:  # another rank's file is still there (or it was already removed)
            pass
    return removed


def wait_for_batch(run_dir: str | Path, step: int, rank: int, timeout_s: float, poll_s: float = 0.5) -> Path:
    """Block until `rollouts/step_<step>/rank_<rank>.npz` exists (complete, thanks to the atomic rename)."""
    path = batch_path(run_dir, step, rank)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no batch at {path} after {timeout_s:.0f}s")
        time.sleep(poll_s)
    return path


__all__ = [
    "FORMAT_VERSION",
    "FIELDS",
    "LOSS_COMPONENTS",  # batch_fields.py's, named here too: the trainer's losses and the orchestrator read it
    "BatchFormatError",
    "TrainingSample",
    "PackedBatch",
    "pack_samples",
    "batch_env_names",
    "step_dir",
    "batch_path",
    "write_batch",
    "read_batch",
    "wait_for_batch",
    "prune_rollouts",
]
