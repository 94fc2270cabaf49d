"""The collective transfer's rendezvous store, open only to holders of the run's secret.

torch's `TCPStore` listens on every interface and answers anyone: a stranger could list its keys, read the
process group's addresses, and register as rank 0 so that a server loads the stranger's bytes. This store
replaces it. The trainer runs `StoreServer` bound to exactly `trainer.broadcast.transfer_host`; every
participant (the trainer itself included) connects with `AuthStore`, a `torch.distributed.Store` that the
gloo/NCCL process groups use like any other store.

Each connection starts with a mutual challenge on the run's admin secret (docs/weight_transfer.md, "Who may
join"):
  server -> client: MAGIC + nonce_s
  client -> server: nonce_c + HMAC(secret, "client" | nonce_s | nonce_c)
  server -> client: HMAC(secret, "server" | nonce_c | nonce_s)
A client that fails the challenge is disconnected before it can read or write a key; a client refuses a
server that cannot answer (an impostor store). After the challenge, requests are length-prefixed JSON frames
(values base64), one at a time per connection; a blocking `get`/`wait` blocks only its own connection.
The channel is authenticated at connection time, not encrypted: keep `transfer_host` on a trusted network
(the weights themselves travel over the process group's own sockets).

Unauthenticated connections are bounded: at most `MAX_PENDING` challenges run at once, each within
`HANDSHAKE_S` in all (not per read: a peer trickling one byte at a time is cut off too); a new connection
beyond the bound evicts the oldest pending one (2,000 idle connections had held 1,437 threads). A real peer
answers in milliseconds, so a flood must evict it within that window to keep it out.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Any

log = logging.getLogger("primejax.transfer")

MAGIC = b"PJXSTORE1"
_NONCE = 32
_MAC = hashlib.sha256().digest_size
_MAX_FRAME = 16 * 2**20  # store values are addresses and small records; a larger frame is hostile
MAX_PENDING = 32  # challenges running at once (module docstring)
HANDSHAKE_S = 10.0  # the whole challenge, from accept to the server's answer


class RendezvousAuthError(ConnectionError):
    """The other end does not hold the run's secret."""


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with `deadline` (time.monotonic()), all of them by then (socket.timeout otherwise)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("rendezvous: handshake deadline passed")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("rendezvous: connection closed")
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > _MAX_FRAME:
        raise ConnectionError(f"rendezvous: frame of {n} bytes refused")
    obj = json.loads(_recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ConnectionError("rendezvous: malformed frame")
    return obj


def _b64(v: bytes) -> str:
    return base64.b64encode(v).decode()


def _unb64(s: Any) -> bytes:
    if not isinstance(s, str):
        raise ValueError("value is not a string")
    return base64.b64decode(s, validate=True)


class StoreServer:
    """The trainer's store: a key -> bytes map served to authenticated clients, bound to `host` only."""

    def __init__(self, host: str, port: int, secret: str):
        if not secret:
            raise ValueError("the collective transfer needs the run's admin secret to authenticate its peers")
        self.secret = secret.encode()
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.data: dict[str, bytes] = {}
        self.cv = threading.Condition()
        self.refused = 0  # connections that failed the challenge (tests and logs)
        self.evicted = 0  # pending challenges closed to make room for a newer connection
        self._pending: OrderedDict[int, socket.socket] = OrderedDict()  # id -> socket, oldest first
        self._pending_lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="pjx-store-accept", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            with self._pending_lock:
                while len(self._pending) >= MAX_PENDING:
                    _, oldest = self._pending.popitem(last=False)
                    self.evicted += 1
                    try:
                        oldest.shutdown(socket.SHUT_RDWR)  # its thread's read fails and the thread ends
                    except OSError:
                        pass
                self._pending[id(conn)] = conn
            threading.Thread(
                target=self._serve, args=(conn, addr), name="pjx-store-conn", daemon=True
            ).start()

    def _handshake(self, conn: socket.socket) -> bool:
        deadline = time.monotonic() + HANDSHAKE_S
        conn.settimeout(HANDSHAKE_S)
        nonce_s = os.urandom(_NONCE)
        conn.sendall(MAGIC + nonce_s)
        reply = _recv_exact(conn, _NONCE + _MAC, deadline)
        nonce_c, mac = reply[:_NONCE], reply[_NONCE:]
        if not hmac.compare_digest(mac, _mac(self.secret, b"client", nonce_s, nonce_c)):
            return False
        conn.sendall(_mac(self.secret, b"server", nonce_c, nonce_s))
        conn.settimeout(None)
        return True

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        with conn:
            try:
                try:
                    passed = self._handshake(conn)
                finally:
                    with self._pending_lock:
                        self._pending.pop(id(conn), None)
                if not passed:
                    with self.cv:
                        self.refused += 1
                    log.warning(
                        "transfer rendezvous: refused a connection from %s (wrong or no run secret)", addr
                    )
                    return
                while True:
                    _send_frame(conn, self._handle(_recv_frame(conn)))
            except (OSError, ValueError, ConnectionError):
                return

    def _handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        try:
            timeout = float(req.get("timeout", 60.0))
            with self.cv:
                if op == "set":
                    self.data[str(req["key"])] = _unb64(req["value"])
                    self.cv.notify_all()
                    return {"ok": True}
                if op in ("get", "wait"):
                    keys = [str(req["key"])] if op == "get" else [str(k) for k in req["keys"]]
                    if not self.cv.wait_for(lambda: all(k in self.data for k in keys), timeout):
                        missing = [k for k in keys if k not in self.data]
                        return {"err": f"timed out after {timeout:.0f} s waiting for {missing[:3]}"}
                    return {"ok": True, "value": _b64(self.data[keys[0]])} if op == "get" else {"ok": True}
                if op == "check":
                    return {"ok": True, "value": all(str(k) in self.data for k in req["keys"])}
                if op == "add":
                    key = str(req["key"])
                    value = int(self.data.get(key, b"0")) + int(req["amount"])
                    self.data[key] = str(value).encode()
                    self.cv.notify_all()
                    return {"ok": True, "value": value}
                if op == "compare_set":
                    key, expected, desired = str(req["key"]), _unb64(req["expected"]), _unb64(req["desired"])
                    current = self.data.get(key)
                    if (current is None and expected == b"") or current == expected:
                        self.data[key] = desired
                        self.cv.notify_all()
                        return {"ok": True, "value": _b64(desired)}
                    return {"ok": True, "value": _b64(expected if current is None else current)}
                if op == "delete":
                    return {"ok": True, "value": self.data.pop(str(req["key"]), None) is not None}
                if op == "num_keys":
                    return {"ok": True, "value": len(self.data)}
        except (KeyError, TypeError, ValueError) as e:
            return {"err": f"malformed {op!r} request: {e}"}
        return {"err": f"unknown op {op!r}"}


def _connect(host: str, port: int, secret: bytes, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        hello = _recv_exact(sock, len(MAGIC) + _NONCE)
        if not hello.startswith(MAGIC):
            raise RendezvousAuthError(f"{host}:{port} is not a primejax transfer rendezvous")
        nonce_s, nonce_c = hello[len(MAGIC) :], os.urandom(_NONCE)
        sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
        try:
            answer = _recv_exact(sock, _MAC)
        except ConnectionError as e:
            raise RendezvousAuthError(f"{host}:{port} refused this process's run secret") from e
        if not hmac.compare_digest(answer, _mac(secret, b"server", nonce_c, nonce_s)):
            raise RendezvousAuthError(
                f"{host}:{port} does not hold the run's secret (not this run's trainer)"
            )
        return sock
    except BaseException:
        sock.close()
        raise


_AUTH_STORE_CLS: type | None = None


def auth_store_cls() -> type:
    """`AuthStore`: a torch.distributed.Store whose every call goes to a `StoreServer` over a challenged socket.

    Keep a Python reference to the instance for as long as torch uses it: torch's Python-store trampoline
    loses its methods when the Python object is collected."""
    global _AUTH_STORE_CLS
    if _AUTH_STORE_CLS is not None:
        return _AUTH_STORE_CLS
    import torch.distributed as dist

    class _AuthStore(dist.Store):
        def __init__(self, host: str, port: int, secret: str, timeout_s: float):
            super().__init__()
            if not secret:
                raise ValueError(
                    "the collective transfer needs the run's admin secret to join the rendezvous"
                )
            self._timeout_s = float(timeout_s)
            self._lock = threading.Lock()
            self._sock = _connect(host, port, secret.encode(), self._timeout_s)
            self._sock.settimeout(self._timeout_s + 30.0)

        def _call(self, **req: Any) -> Any:
            req.setdefault("timeout", self._timeout_s)
            with self._lock:
                _send_frame(self._sock, req)
                reply = _recv_frame(self._sock)
            if "err" in reply:
                raise RuntimeError(f"transfer rendezvous: {reply['err']}")
            return reply.get("value")

        def set(self, key: str, value: Any) -> None:
            self._call(
                op="set", key=key, value=_b64(value.encode() if isinstance(value, str) else bytes(value))
            )

        def get(self, key: str) -> bytes:
            return _unb64(self._call(op="get", key=key))

        def add(self, key: str, amount: int) -> int:
            return int(self._call(op="add", key=key, amount=int(amount)))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            def raw(v: Any) -> str:
                return _b64(v.encode() if isinstance(v, str) else bytes(v))

            return _unb64(self._call(op="compare_set", key=key, expected=raw(expected), desired=raw(desired)))

        def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
            t = self._timeout_s if timeout is None else timeout.total_seconds()
            self._call(op="wait", keys=list(keys), timeout=t)

        def check(self, keys: list[str]) -> bool:
            return bool(self._call(op="check", keys=list(keys)))

        def delete_key(self, key: str) -> bool:
            return bool(self._call(op="delete", key=key))

        def num_keys(self) -> int:
            return int(self._call(op="num_keys"))

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return [self.get(k) for k in keys]

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            for k, v in zip(keys, values, strict=True):
                self.set(k, v)

        def close(self) -> None:
            try:
                self._sock.close()
            except OSError:
                pass

    _AUTH_STORE_CLS = _AuthStore
    return _AUTH_STORE_CLS


def connect_store(host: str, port: int, secret: str, timeout_s: float) -> Any:
    """An authenticated client of the store at host:port (raises RendezvousAuthError for an impostor)."""
    return auth_store_cls()(host, port, secret, timeout_s)
