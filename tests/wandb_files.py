"""Reading a W&B run as W&B wrote it (no network, no W&B server): the records of an offline run's file."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def wandb_records(run_file):
    """The records of a W&B run file (`run-*.wandb`: a LevelDB-style log of `wandb_internal_pb2.Record`s in
    32 KiB blocks, each chunk a 7-byte header: crc32, little-endian length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    offset, block, pending, records = 7, 32 * 1024, b"", []
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:
            break
        pending += chunk
        if kind in (1, 4):  # full, last
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def run_files(run_dir: str | Path) -> list[Path]:
    """Every W&B run file of a primejax run directory (one per process that logged to W&B)."""
    return sorted(Path(run_dir).glob("wandb/wandb/*run-*/run-*.wandb"))


def _one(run_dir: str | Path, job_type: str | None) -> list[Any]:
    for path in run_files(run_dir):
        records = wandb_records(path)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        if job_type is None or run.job_type == job_type:
            return records
    raise AssertionError(f"no W&B run of {job_type or 'any process'} under {run_dir}/wandb")


def wandb_history(run_dir: str | Path, job_type: str | None = None) -> dict[int, dict[str, Any]]:
    """The logged values by step; a media value (histogram, table) is stored under nested keys
    (`samples/_type`, ...). Values are W&B's JSON text."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in _one(run_dir, job_type):
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
            by_step.setdefault(int(json.loads(row["_step"])), {}).update(row)
    return by_step


def wandb_run(run_dir: str | Path, job_type: str | None = None) -> Any:
    """The run record (group, display name, job type, config) of the process `job_type`."""
    return next(r.run for r in _one(run_dir, job_type) if r.WhichOneof("record_type") == "run")
