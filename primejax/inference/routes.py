"""primejax's admin routes on the inference server: weight updates, pause/resume, liveness, weight version.

The routes speak to the engine only through `AdminEngine` (five coroutines), which `vllm_ext` implements on
top of vLLM; nothing here imports vLLM, so the request handling (validation, locking, versioning, error
codes) is the same whatever engine version sits underneath.

Update protocol: validate the directory from file headers (4xx and nothing touched if bad) -> freeze
scheduling with in-flight requests kept -> load in place -> drop cached KV computed with the old weights
(running requests are recomputed, none is lost) -> resume -> publish the new version. A request that
straddles an update has its earlier tokens (and their logprobs) from the old weights and the rest from the
new ones; callers that track policy versions should stamp a sample with the version at its start.

A weight transport with a route of its own (transports/weights/registry.py) gets it without an edit here:
transport_routes.py mounts it beside these and hands it this protocol (`_update_from_dir`, `_load_with`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from primejax.inference import identity
from primejax.inference.admin_auth import HEADER, authorized, confine
from primejax.transports.weights.adapters.dirs import (
    AdapterSet,
    adapter_name,
    check_adapter_dir,
    is_adapter_dir,
)
from primejax.transports.weights.adapters.receiver import (
    PrivateAdapterDirs,
    check_adapter_round,
    is_adapter_round,
    receive_adapter,
)
from primejax.transports.weights.validate import WeightDirError, check_stable, version_from_dir

logger = logging.getLogger("primejax.inference")

BASE_VERSION = 0


class AdminEngine(Protocol):
    async def pause(self) -> None: ...  # stop scheduling; keep in-flight requests queued
    async def resume(self) -> None: ...
    async def load_weights(self, weight_dir: str) -> None: ...  # in place, from an HF safetensors dir
    async def reset_cache(self) -> None: ...  # forget KV computed with previous weights
    async def check_health(self) -> None: ...  # raises if the engine is dead

    # Optional (collective updates): one round of vLLM's weight-transfer engine protocol.
    # async def transfer_weights(self, init_info: dict, update_info: dict) -> None: ...
    # Optional (LoRA servers, transports/weights/adapters/dirs.py): adapters loaded next to the frozen base, by name.
    # async def load_adapter(self, name: str, adapter_dir: str) -> None: ...
    # async def unload_adapter(self, name: str) -> None: ...
    # def adapter_in_use(self, name: str) -> bool: ...  # a request in the engine samples with it
    # Optional: each worker's sha256 of every served parameter (POST /weights_digest).
    # async def weights_digest(self) -> list[dict[str, str]]: ...


@dataclass
class AdminState:
    engine: AdminEngine
    base_dir: str
    validate: Callable[[str], None]  # raises WeightDirError
    version: int = BASE_VERSION
    weight_dir: str = ""  # "" after a collective update: the served weights exist in no directory
    user_paused: bool = False
    # Collective updates: checks an update info's tensor names/shapes (raises WeightDirError); None = disabled.
    check_transfer: Callable[[dict], None] | None = None
    transport: str = "filesystem"  # how the served weights arrived: filesystem | collective
    last_load_s: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    admin_token: str | None = None  # required on the POST routes (admin_auth.protect); None = open (tests)
    weights_root: str = ""  # loads must resolve inside it; "" = anywhere
    require_stable: bool = False  # only directories with a STABLE manifest (checked file by file) load
    # Why the served weights are undefined (a failed load that could not restore): /liveness answers 503, the
    # server stays paused (nothing is sampled from them) until a full load succeeds or the launcher restarts it.
    unhealthy: str = ""
    # LoRA (transports/weights/adapters/dirs.py): the server's --max-lora-rank (0 = no LoRA), the adapters loaded and served,
    # and the task unloading retired adapters once no request uses them.
    max_lora_rank: int = 0
    adapters: AdapterSet = field(default_factory=AdapterSet)
    reaper: asyncio.Task | None = None
    # Collective adapter rounds (transports/weights/adapters/receiver.py): this process's receiver (its groups reused
    # round after round) and the private directories of the adapters received that way.
    adapter_receiver: Any = None
    private_adapters: PrivateAdapterDirs = field(default_factory=PrivateAdapterDirs)

    def __post_init__(self) -> None:
        self.weight_dir = self.weight_dir or self.base_dir

    def describe(self) -> dict[str, Any]:
        version = -1 if self.unhealthy else self.version
        return {
            "version": version,
            "weight_dir": self.weight_dir,
            "load_seconds": self.last_load_s,
            "transport": self.transport,
            "adapter": self.adapters.current,
            "adapters_loaded": list(self.adapters.loaded),
        }


router = APIRouter()


def _state(request: Request) -> AdminState:
    return request.app.state.primejax


def _error(status: HTTPStatus, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status.value)


async def _json_body(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        body = await request.json()
    except ValueError:
        return _error(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
    if not isinstance(body, dict):
        return _error(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
    return body


async def _after_failed_load(state: AdminState, what: str) -> str:
    """A load stopped half-way: put back the previous weights when they live in a directory; otherwise (they
    came collectively, or restoring failed too) the served weights are undefined: the server stays paused and
    reports unhealthy until a full load succeeds (or the launcher restarts it)."""
    if state.weight_dir:
        try:
            await state.engine.load_weights(state.weight_dir)
            await state.engine.reset_cache()
            return f"still serving version {state.version}"
        except Exception:
            logger.exception("restoring %s failed", state.weight_dir)
    state.unhealthy = f"{what} and the previous weights could not be restored"
    return (
        "the served weights are undefined: the server stays paused and reports unhealthy until a full "
        "weight update (/update_weights) succeeds"
    )


async def _swap(state: AdminState, weight_dir: str, version: int) -> JSONResponse:
    """Load `weight_dir` in place under the state lock; on failure try to restore the previous weights."""
    t0 = time.perf_counter()
    await state.engine.pause()
    try:
        try:
            await state.engine.load_weights(weight_dir)
        except Exception as e:
            logger.exception(
                "loading %s failed; restoring %s", weight_dir, state.weight_dir or "(none on disk)"
            )
            restored = await _after_failed_load(state, f"loading {weight_dir} failed")
            return _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"loading {weight_dir} failed ({e}); {restored}")
        await state.engine.reset_cache()
        state.unhealthy = ""
    finally:
        if not state.user_paused and not state.unhealthy:
            await state.engine.resume()
    state.version, state.weight_dir, state.transport = version, weight_dir, "filesystem"
    state.last_load_s = time.perf_counter() - t0
    state.adapters.serve_base()  # requests go to the weights just loaded, not to an adapter
    _start_reaper(state)
    logger.info("serving weights version %d from %s (%.3f s)", version, weight_dir, state.last_load_s)
    return JSONResponse(state.describe())


# How often the reaper looks again at a retired adapter that a request still uses.
REAP_POLL_S = 1.0


async def _serve_adapter(
    state: AdminState,
    adapter_dir: str,
    version: int,
    transport: str = "filesystem",
    t0: float | None = None,
    loaded: bool = False,
) -> JSONResponse:
    """Load a PEFT adapter next to the others under `adapter_name(version)` (unless `loaded`) and serve it (no
    pause, no cache reset: requests on the previous adapter finish on it; transports/weights/adapters/dirs.py)."""
    if not hasattr(state.engine, "load_adapter"):
        return _error(HTTPStatus.NOT_IMPLEMENTED, "this server's engine cannot load LoRA adapters")
    t0 = time.perf_counter() if t0 is None else t0
    name = adapter_name(version)
    try:
        if not loaded:
            await state.engine.load_adapter(name, adapter_dir)  # type: ignore[attr-defined]
    except Exception as e:
        logger.exception("loading adapter %s from %s failed", name, adapter_dir)
        return _error(
            HTTPStatus.INTERNAL_SERVER_ERROR,
            f"loading LoRA adapter {adapter_dir} failed ({e}); still serving version {state.version}",
        )
    state.adapters.serve(name)
    if transport == "filesystem":  # the name's earlier collective copy (if any) is no longer what vLLM reads
        state.private_adapters.drop(name)
    state.version, state.weight_dir, state.transport = version, adapter_dir, transport
    state.last_load_s = time.perf_counter() - t0
    logger.info(
        "serving policy version %d as LoRA adapter %s from %s (%.3f s)",
        version,
        name,
        adapter_dir,
        state.last_load_s,
    )
    await _reap(state)
    _start_reaper(state)
    return JSONResponse(state.describe())


async def _reap(state: AdminState) -> None:
    """Unload each retired adapter that no request in the engine uses (call with the state lock held)."""
    for name in state.adapters.retirable():
        if state.engine.adapter_in_use(name):  # type: ignore[attr-defined]
            continue
        try:
            await state.engine.unload_adapter(name)  # type: ignore[attr-defined]
        except Exception:
            logger.exception("unloading adapter %s failed; tried again later", name)
            continue
        state.adapters.unloaded(name)
        state.private_adapters.drop(name)
        logger.info("unloaded LoRA adapter %s (no request uses it)", name)


def _start_reaper(state: AdminState) -> None:
    if state.adapters.retirable() and (state.reaper is None or state.reaper.done()):
        state.reaper = asyncio.create_task(_reap_until_done(state))


async def _reap_until_done(state: AdminState) -> None:
    while state.adapters.retirable():
        async with state.lock:
            await _reap(state)
        if state.adapters.retirable():
            await asyncio.sleep(REAP_POLL_S)


@router.post("/update_weights")
async def update_weights(request: Request) -> JSONResponse:
    """Body: {"weight_dir": str, "version": int (optional; default: N of a `.../step_N` dir)}. A PEFT adapter
    directory (LoRA servers) is loaded as an adapter named after the version (transports/weights/adapters/dirs.py)."""
    state = _state(request)
    body = await _json_body(request)
    if isinstance(body, JSONResponse):
        return body
    weight_dir = body.get("weight_dir")
    if not isinstance(weight_dir, str) or not weight_dir:
        return _error(HTTPStatus.BAD_REQUEST, "'weight_dir' (a directory path) is required")
    return await _update_from_dir(state, weight_dir, body.get("version", version_from_dir(weight_dir)))


async def _update_from_dir(state: AdminState, weight_dir: str, version: Any) -> JSONResponse:
    """/update_weights after its body is read: confine, check, then load the directory (or adapter)."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        return _error(
            HTTPStatus.BAD_REQUEST,
            f"cannot tell the weight version: pass 'version' (int >= 0) or name the dir step_N ({weight_dir})",
        )
    refused = confine(weight_dir, state.weights_root)
    if refused:  # before any look at the disk: a caller learns nothing about paths outside the root
        return _error(HTTPStatus.FORBIDDEN if os.path.isabs(weight_dir) else HTTPStatus.BAD_REQUEST, refused)
    weight_dir = str(Path(weight_dir).resolve())
    if is_adapter_dir(weight_dir):
        async with state.lock:
            try:
                await run_in_threadpool(check_stable, weight_dir, state.require_stable)
                await run_in_threadpool(
                    check_adapter_dir,
                    weight_dir,
                    state.max_lora_rank,
                    getattr(state.validate, "reference", None),
                )
            except WeightDirError as e:
                return _error(HTTPStatus.UNPROCESSABLE_ENTITY, f"{e}; still serving version {state.version}")
            return await _serve_adapter(state, weight_dir, version)
    async with state.lock:
        try:
            await run_in_threadpool(check_stable, weight_dir, state.require_stable)
            await run_in_threadpool(state.validate, weight_dir)
        except WeightDirError as e:
            status = (
                HTTPStatus.NOT_FOUND if not Path(weight_dir).exists() else HTTPStatus.UNPROCESSABLE_ENTITY
            )
            return _error(status, f"{e}; still serving version {state.version}")
        return await _swap(state, weight_dir, version)


@router.post("/reload_weights")
async def reload_weights(request: Request) -> JSONResponse:
    """Go back to the base model the server was started with (version 0)."""
    state = _state(request)
    async with state.lock:
        return await _swap(state, state.base_dir, BASE_VERSION)


def _described(request: Request) -> dict[str, Any]:
    """`describe()` for a GET, which anyone may make: the served directory's absolute path (and a failure's
    details, which name paths) only for holders of the admin secret; others see its last component."""
    state = _state(request)
    described = state.describe()
    if not authorized(state.admin_token, request.headers.get(HEADER)):
        described["weight_dir"] = Path(described["weight_dir"]).name if described["weight_dir"] else ""
    return described


@router.get("/weights_version")
async def weights_version(request: Request) -> JSONResponse:
    return JSONResponse(_described(request))


@router.post("/weights_digest")
async def weights_digest(request: Request) -> JSONResponse:
    """sha256 of every served parameter, per worker (vLLM's names and fused layout): what the server serves,
    comparable bit for bit across servers and update paths (tests/gpu)."""
    state = _state(request)
    digest = getattr(state.engine, "weights_digest", None)
    if digest is None:
        return _error(HTTPStatus.NOT_IMPLEMENTED, "this engine cannot report its weights")
    async with state.lock:
        workers = await digest()
    return JSONResponse({"version": state.version, "workers": workers})


@router.post("/weights_read")
async def weights_read(request: Request) -> JSONResponse:
    """The served parameters under the given name prefixes, raw, per worker: {"prefixes": ["model.layers.0."]}
    -> {"version", "workers": [{name: {dtype, shape, data (base64)}}]}. What an FP8 server serves after an update
    is checked against the quantization of the weights sent with this (docs/fp8.md); at most 256 MiB."""
    state = _state(request)
    read = getattr(state.engine, "read_params", None)
    if read is None:
        return _error(HTTPStatus.NOT_IMPLEMENTED, "this engine cannot read back its weights")
    body = await _json_body(request)
    if isinstance(body, JSONResponse):
        return body
    prefixes = body.get("prefixes")
    if (
        not isinstance(prefixes, list)
        or not 0 < len(prefixes) <= 64
        or not all(isinstance(p, str) and 0 < len(p) <= 512 for p in prefixes)
    ):
        return _error(HTTPStatus.BAD_REQUEST, "prefixes: a list of 1-64 non-empty parameter-name prefixes")
    async with state.lock:
        try:
            workers = await read(prefixes)
        except ValueError as e:
            return _error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(e))
    for w in workers:
        for t in w.values():
            t["data"] = base64.b64encode(t["data"]).decode()
    return JSONResponse({"version": state.version, "workers": workers})


@router.post("/pause")
async def pause(request: Request) -> JSONResponse:
    """Stop scheduling; in-flight and new requests wait (none is dropped) until /resume."""
    state = _state(request)
    async with state.lock:
        state.user_paused = True
        await state.engine.pause()
    return JSONResponse({"status": "paused"})


@router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    state = _state(request)
    async with state.lock:
        state.user_paused = False
        await state.engine.resume()
    return JSONResponse({"status": "resumed"})


@router.get(identity.ROUTE)
async def prove_identity(request: Request, nonce: str = "") -> JSONResponse:
    """Answer the client's challenge with the run's secret (primejax.inference.identity): proves this is the
    run's own server without sending the secret."""
    if not 8 <= len(nonce) <= 128:
        return _error(HTTPStatus.BAD_REQUEST, "nonce: 8 to 128 characters")
    return JSONResponse({"proof": identity.proof(_state(request).admin_token or "", nonce)})


@router.get("/liveness")
async def liveness(request: Request) -> JSONResponse:
    state = _state(request)
    admin = authorized(state.admin_token, request.headers.get(HEADER))
    if state.unhealthy:
        return _error(
            HTTPStatus.SERVICE_UNAVAILABLE, f"unhealthy: {state.unhealthy if admin else '(details: admin)'}"
        )
    try:
        await state.engine.check_health()
    except Exception as e:
        return _error(
            HTTPStatus.SERVICE_UNAVAILABLE, f"engine unhealthy: {e if admin else '(details: admin)'}"
        )
    return JSONResponse({"status": "ok", **_described(request)})


# Margin over the transfer's own (gloo/NCCL) timeout before the route stops waiting for the engine.
TRANSFER_GRACE_S = 30.0


async def _load_with(
    state: AdminState, version: int, transport: str, load: Callable[[Any], Awaitable[None]]
) -> JSONResponse:
    """The update protocol around a load that is no directory (call with the state lock held): pause -> `await
    load(engine)` -> cache reset -> resume -> version; on failure restore the previous weights or go unhealthy."""
    t0 = time.perf_counter()
    await state.engine.pause()
    try:
        try:
            await load(state.engine)
        except Exception as e:
            logger.exception("%s weight update of version %d failed", transport, version)
            what = f"{transport} transfer of version {version} failed"
            restored = await _after_failed_load(state, f"the {what}")
            return _error(HTTPStatus.BAD_GATEWAY, f"{what} ({type(e).__name__}: {str(e)[:300]}); {restored}")
        await state.engine.reset_cache()
        state.unhealthy = ""
    finally:
        if not state.user_paused and not state.unhealthy:
            await state.engine.resume()
    state.version, state.weight_dir, state.transport = version, "", transport
    state.adapters.serve_base()
    _start_reaper(state)
    state.last_load_s = time.perf_counter() - t0
    logger.info("serving weights version %d received by %s (%.3f s)", version, transport, state.last_load_s)
    return JSONResponse(state.describe())


async def _transfer(
    state: AdminState, init_info: dict, update_info: dict, version: int, timeout_s: float
) -> JSONResponse:
    async def load(engine: Any) -> None:
        await asyncio.wait_for(engine.transfer_weights(init_info, update_info), timeout_s + TRANSFER_GRACE_S)

    return await _load_with(state, version, "collective", load)


@router.post("/transfer_weights")
async def transfer_weights(request: Request) -> JSONResponse:
    """Collective update through vLLM's weight-transfer engine (docs/weight_transfer.md).

    Body: {"version": int, "init_info": {...}, "update_info": {...}}; the trainer must be sending. Same
    protocol as /update_weights (pause with in-flight requests kept -> load -> cache reset -> resume ->
    version). Named apart from vLLM's dev-mode `/update_weights` (one chunk of the engine protocol), which
    would otherwise collide with primejax's filesystem `/update_weights`; dev mode stays off.
    """
    state = _state(request)
    body = await _json_body(request)
    if isinstance(body, JSONResponse):
        return body
    version, init_info, update_info = body.get("version"), body.get("init_info"), body.get("update_info")
    if (
        state.check_transfer is None or not hasattr(state.engine, "transfer_weights")
    ) and not is_adapter_round(update_info):
        return _error(
            HTTPStatus.NOT_IMPLEMENTED,
            "collective weight transfer is not enabled on this server "
            "(start it with the primejax weight-transfer engine; see docs/weight_transfer.md)",
        )
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        return _error(HTTPStatus.BAD_REQUEST, "'version' (int >= 0) is required")
    if not isinstance(init_info, dict) or not isinstance(update_info, dict):
        return _error(HTTPStatus.BAD_REQUEST, "'init_info' and 'update_info' (JSON objects) are required")
    timeout_s = init_info.get("timeout_s", 60.0)
    if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 86400:
        return _error(HTTPStatus.BAD_REQUEST, "'init_info.timeout_s' must be a number of seconds > 0")
    if is_adapter_round(update_info):
        return await _transfer_adapter(state, init_info, update_info, version, float(timeout_s))
    try:
        state.check_transfer(update_info)
    except (WeightDirError, KeyError, TypeError, ValueError) as e:
        return _error(
            HTTPStatus.UNPROCESSABLE_ENTITY, f"update_info: {e}; still serving version {state.version}"
        )
    async with state.lock:
        return await _transfer(state, init_info, update_info, version, float(timeout_s))


async def _transfer_adapter(
    state: AdminState, init_info: dict, update_info: dict, version: int, timeout_s: float
) -> JSONResponse:
    """A collective LoRA adapter round (transports/weights/adapters/receiver.py): checked first (422, nothing received),
    received by this process into a private PEFT directory and loaded as `adapter_name(version)` before the
    round is acknowledged (an acknowledged round is a served one), then served like a filesystem adapter.
    Nothing is paused: a failed round loads nothing and the served adapter stays."""
    try:
        check_adapter_round(init_info, update_info, state.max_lora_rank)
    except WeightDirError as e:
        return _error(HTTPStatus.UNPROCESSABLE_ENTITY, f"{e}; still serving version {state.version}")
    if not hasattr(state.engine, "load_adapter"):
        return _error(HTTPStatus.NOT_IMPLEMENTED, "this server's engine cannot load LoRA adapters")
    name, loop, loaded = adapter_name(version), asyncio.get_running_loop(), []

    def load(directory: Path) -> None:  # on the receiving thread, between the digest check and the ack
        coro = state.engine.load_adapter(name, str(directory))  # type: ignore[attr-defined]
        asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s + TRANSFER_GRACE_S)
        loaded.append(name)

    async with state.lock:
        if state.adapter_receiver is None:
            from primejax.transports.weights.collective.wire import Receiver

            state.adapter_receiver = Receiver()
        t0 = time.perf_counter()
        directory = state.private_adapters.create()
        try:
            await asyncio.wait_for(
                run_in_threadpool(
                    receive_adapter,
                    state.adapter_receiver,
                    init_info,
                    update_info,
                    state.admin_token,
                    directory,
                    load,
                ),
                2 * timeout_s + TRANSFER_GRACE_S,
            )
        except Exception as e:
            logger.exception("collective transfer of LoRA adapter version %d failed", version)
            if loaded:  # loaded but not acknowledged: the trainer falls back to the filesystem broadcast
                try:
                    await state.engine.unload_adapter(name)  # type: ignore[attr-defined]
                except Exception:
                    logger.exception("unloading the unacknowledged adapter %s failed", name)
            shutil.rmtree(directory, ignore_errors=True)
            return _error(
                HTTPStatus.BAD_GATEWAY,
                f"collective transfer of LoRA adapter version {version} failed "
                f"({type(e).__name__}: {str(e)[:300]}); nothing loaded, still serving version "
                f"{state.version}",
            )
        state.private_adapters.keep(name, directory)
        return await _serve_adapter(state, str(directory), version, "collective", t0, loaded=True)


@router.post("/init_broadcaster")
async def init_broadcaster(request: Request) -> JSONResponse:
    return _error(
        HTTPStatus.NOT_IMPLEMENTED,
        "/init_broadcaster is not implemented: collective updates go through /transfer_weights (one call per "
        "update, vLLM's weight-transfer engine protocol underneath); filesystem updates through /update_weights",
    )
