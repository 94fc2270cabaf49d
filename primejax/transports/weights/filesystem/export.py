"""The parallel safetensors export: every trainer process writes its own row blocks into the shared files.

The gather export (primejax.models.hf_io.export_safetensors) brings each whole tensor to the host of every
process (a cross-process all-gather per tensor) and writes files one after another. Here the layout of every
file is fixed first from shapes alone (the same file plan and names as the gather export: file i holds the same
tensors), and each process then writes only the row blocks its own devices hold (primejax.transports.weights.shards), each
at its offset (below), from a pool of threads (the device-to-host copy of one parameter overlaps the writes of the
previous ones). A row block is contiguous in the file because safetensors stores tensors row-major.

How the bytes go in (`writer`): every process converts the same parameter at the same time (the conversion is
one SPMD program over all processes), so they all write into the same file at once. A buffered `pwrite` holds the
file's inode lock, so those writers take turns: one file's page-cache copy rate for the whole host. "mmap" copies
into a shared mapping of the file instead, whose page faults take no inode lock, so every process and thread
copies at once. The file's blocks are reserved first (`posix_fallocate`): a full disk is then one clean OSError
before any byte is written, not a SIGBUS on a page fault of the mapping. "pwrite" is the locked path. Process 0 also
writes every file's header, the index and config.json. The caller makes the directory atomic and waits for
every process (primejax.transports.weights.publish).
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from primejax.models.config import ModelConfig
from primejax.models.hf_io import plan_files, write_export_metadata
from primejax.transports.weights.shards import RowShards
from primejax.transports.weights.tensors import piece_bytes, rows

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
DEFAULT_THREADS = 8
_MAX_PENDING_BYTES = 2 * 2**30  # host copies waiting for their write, at most


def _layout(
    shards: RowShards, max_shard_bytes: int
) -> tuple[list[tuple[str, bytes, int]], dict[str, str], list]:
    """([(file name, header bytes, file size)], weight map, per tensor (file index, absolute data offset))."""
    metas = shards.metas
    files = plan_files([(m.name, m.nbytes) for m in metas], max_shard_bytes)
    by_name = {m.name: i for i, m in enumerate(metas)}
    out, weight_map, where = [], {}, [None] * len(metas)
    for f, names in enumerate(files):
        fname = f"model-{f + 1:05d}-of-{len(files):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        at = 0
        for n in names:
            m = metas[by_name[n]]
            header[n] = {
                "dtype": _ST_DTYPES[m.dtype],
                "shape": list(m.shape),
                "data_offsets": [at, at + m.nbytes],
            }
            where[by_name[n]] = (f, at)
            at += m.nbytes
            weight_map[n] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as safetensors writes it
        data_start = 8 + len(raw)
        for n in names:
            i = by_name[n]
            where[i] = (f, data_start + where[i][1])
        out.append((fname, len(raw).to_bytes(8, "little") + raw, data_start + at))
    return out, weight_map, where


def export_parallel(
    model: Any,
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    dtype: str,
    src_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 2**30,
    threads: int = DEFAULT_THREADS,
    writer: str = "mmap",
) -> dict:
    """Write this process's share of the HF directory `out_dir` (which must exist). Every process calls it.
    Returns {"bytes" (total), "bytes_written" (this process's), "seconds", "files"}."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    shards = RowShards(model, cfg, dtype)
    files, weight_map, where = _layout(shards, max_shard_bytes)
    me = shards.process
    pieces = shards.pieces()
    mine = {f for p in pieces if p.sender == me for f in [where[p.tensor][0]]}
    if me == 0:
        mine = set(range(len(files)))
    if writer not in ("mmap", "pwrite"):
        raise ValueError(f"export writer must be 'mmap' or 'pwrite', got {writer!r}")
    fds: dict[int, int] = {}
    maps: dict[int, mmap.mmap] = {}
    try:
        for f in sorted(mine):
            name, header, size = files[f]
            fds[f] = os.open(out_dir / name, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(fds[f], size)  # every process sets the same size: harmless in any order
            if writer == "mmap":
                os.posix_fallocate(fds[f], 0, size)  # ENOSPC here, not as a SIGBUS inside the mapping
                maps[f] = mmap.mmap(fds[f], size)
            if me == 0:
                os.pwrite(fds[f], header, 0)
        written = _write_pieces(shards, fds, maps, where, threads)
    finally:
        for m in maps.values():
            m.close()
        for fd in fds.values():
            os.close(fd)
    total = sum(m.nbytes for m in shards.metas)
    if me == 0:
        write_export_metadata(out_dir, cfg, weight_map, total, dtype, src_dir)
    return {
        "bytes": total,
        "bytes_written": written,
        "files": len(files),
        "seconds": time.perf_counter() - start,
    }


def _write_pieces(
    shards: RowShards, fds: dict[int, int], maps: dict[int, mmap.mmap], where: list, threads: int
) -> int:
    metas = shards.metas
    pending: deque[tuple[Future, int]] = deque()
    held = written = 0

    def write(f: int, data: Any, offset: int) -> int:
        buf = np.ascontiguousarray(np.asarray(data)).view(np.uint8).reshape(-1)
        if f in maps:  # numpy's copy releases the GIL: the pool's threads copy in parallel
            np.frombuffer(maps[f], np.uint8, buf.nbytes, offset)[...] = buf
            return buf.nbytes
        n = os.pwrite(fds[f], buf.data, offset)
        if n != buf.nbytes:
            raise OSError(f"short write: {n} of {buf.nbytes} bytes")
        return n

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for piece, data in shards.local(host=True):
            m = metas[piece.tensor]
            f, base = where[piece.tensor]
            nbytes = piece_bytes(m, piece)
            offset = base + piece.start * (m.nbytes // max(rows(m), 1))
            pending.append((pool.submit(write, f, data, offset), nbytes))
            held += nbytes
            while held > _MAX_PENDING_BYTES and pending:
                fut, n = pending.popleft()
                written += fut.result()
                held -= n
        while pending:
            written += pending.popleft()[0].result()
    return written
