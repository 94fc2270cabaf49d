"""The trainer -> inference contract: weight broadcasts on disk.

After step N the trainer writes `broadcasts/step_N/` (HF safetensors shards, their index, config.json): the
files go into a temp directory that is renamed into place, and only then a `STABLE` marker is written inside
it. The marker is a JSON manifest (format version, step, each file's size and, unless disabled, sha256), so
a reader that sees `STABLE` sees a complete directory and can verify it. Readers (the orchestrator, which
tells vLLM to load the directory) only ever consider directories with a `STABLE` marker.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from primejax.contracts.rundir import RunDir, step_dirs
from primejax.utils.io import atomic_dir, atomic_write_json

FORMAT_VERSION = 1
STABLE = "STABLE"


class BroadcastError(RuntimeError):
    """A broadcast directory that is incomplete or does not match its manifest."""


def broadcasts_root(run_dir: str | Path) -> Path:
    return RunDir(run_dir).broadcasts()


def broadcast_dir(run_dir: str | Path, step: int) -> Path:
    return RunDir(run_dir).broadcasts(step)


def _file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _manifest(directory: Path, step: int, hash_files: bool) -> dict[str, Any]:
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != STABLE:
            entry: dict[str, Any] = {"size": p.stat().st_size}
            if hash_files:
                entry["sha256"] = _file_sha256(p)
            files[str(p.relative_to(directory))] = entry
    # `hashed: false` is the trainer's explicit opt-out (trainer.broadcast.hash = False); a manifest that lacks
    # hashes without saying so is incomplete or hand-made, and a verifying reader refuses it.
    return {"format_version": FORMAT_VERSION, "step": step, "files": files, "hashed": hash_files}


def write_broadcast(
    run_dir: str | Path, step: int, write_fn: Callable[[Path], Any], hash_files: bool = True
) -> tuple[Path, Any]:
    """Call `write_fn(tmp_dir)` to fill a temp directory, rename it to `broadcasts/step_<step>`, mark it STABLE.

    Returns (the final directory, write_fn's return value). An existing directory for the same step (a
    re-export after a restart) is replaced.
    """
    final = broadcast_dir(run_dir, step)
    with atomic_dir(final, overwrite=True) as tmp:
        result = write_fn(tmp)
        manifest = _manifest(tmp, step, hash_files)
    atomic_write_json(final / STABLE, manifest)
    return final, result


def publish_broadcast(run_dir: str | Path, step: int, filled: Path, hash_files: bool = True) -> Path:
    """`write_broadcast` for a directory several processes filled (multi-host export, a shared filesystem):
    rename `filled` to `broadcasts/step_<step>` (replacing an older one) and mark it STABLE."""
    final = broadcast_dir(run_dir, step)
    manifest = _manifest(filled, step, hash_files)
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        filled.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        filled.rename(final)
    atomic_write_json(final / STABLE, manifest)
    return final


def is_stable(directory: str | Path) -> bool:
    return (Path(directory) / STABLE).is_file()


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / STABLE
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise BroadcastError(f"{directory}: no {STABLE} marker (incomplete broadcast)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BroadcastError(f"{path}: unreadable manifest ({e})") from None
    except RecursionError:
        raise BroadcastError(f"{path}: unreadable manifest (nested too deeply)") from None
    if not isinstance(manifest, dict):
        raise BroadcastError(f"{path}: the manifest is not a JSON object")
    return manifest


def verify_broadcast(directory: str | Path, check_hashes: bool = True) -> dict[str, Any]:
    """Check every file of the manifest exists with its size (and sha256); return the manifest.

    A manifest that lists no weights, leaves a weights file of the directory out, or (with `check_hashes`)
    has an entry without its sha256 is refused: it would vouch for weights it never described."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BroadcastError(
            f"{directory}: format_version {manifest.get('format_version')!r} != {FORMAT_VERSION}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not any(str(n).endswith(".safetensors") for n in files):
        raise BroadcastError(f"{directory}: the {STABLE} manifest lists no .safetensors file")
    unlisted = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in files)
    if unlisted:
        raise BroadcastError(f"{directory}: {unlisted[0]} is not in the {STABLE} manifest")
    for name, entry in files.items():
        hashed = manifest.get("hashed", True) is not False
        if not isinstance(entry, dict) or (
            check_hashes and hashed and not isinstance(entry.get("sha256"), str)
        ):
            raise BroadcastError(f"{directory}: the {STABLE} manifest entry of {name} has no sha256")
        size = entry.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise BroadcastError(f"{directory}: the {STABLE} manifest entry of {name} has no size in bytes")
        parts = Path(name).parts
        if (
            not parts or Path(name).is_absolute() or ".." in parts
        ):  # it vouches for files of this directory only
            raise BroadcastError(f"{directory}: the {STABLE} manifest names {name!r}, outside its directory")
        p = directory / name
        if not p.is_file():
            raise BroadcastError(f"{directory}: missing file {name}")
        if p.stat().st_size != entry["size"]:
            raise BroadcastError(
                f"{directory}: {name} has {p.stat().st_size} bytes, manifest says {entry['size']}"
            )
        if check_hashes and "sha256" in entry and _file_sha256(p) != entry["sha256"]:
            raise BroadcastError(f"{directory}: {name} sha256 mismatch")
    return manifest


def stable_steps(run_dir: str | Path) -> list[int]:
    return [s for s, p in step_dirs(broadcasts_root(run_dir)) if is_stable(p)]


def latest_stable_step(run_dir: str | Path) -> int | None:
    steps = stable_steps(run_dir)
    return steps[-1] if steps else None


def prune_broadcasts(run_dir: str | Path, keep_from_step: int) -> list[int]:
    """Delete broadcasts of steps < keep_from_step (complete or not); return the deleted steps.

    With async level k, inference may still be asked to load step n - k while the trainer finishes step n,
    so the trainer calls this with keep_from_step = n - k.
    """
    deleted = []
    for step, p in step_dirs(broadcasts_root(run_dir)):
        if step >= keep_from_step:
            break
        # Drop the marker first so no reader picks up a directory that is being deleted.
        (p / STABLE).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
        deleted.append(step)
    return deleted


__all__ = [
    "STABLE",
    "BroadcastError",
    "broadcasts_root",
    "broadcast_dir",
    "write_broadcast",
    "is_stable",
    "read_manifest",
    "verify_broadcast",
    "stable_steps",
    "latest_stable_step",
    "prune_broadcasts",
]
