"""The collective transfer's rendezvous answers only the run: strangers cannot read keys, receive weights or
register as rank 0; the store binds only where configured; a round whose bytes differ from the sender's
digest is not acknowledged."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch

from primejax.transports.weights.collective import rendezvous, wire
from primejax.transports.weights.collective.offer import latest_offer
from primejax.transports.weights.collective.sender import CollectiveSender

SECRET = "the-run-secret"


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(33, 7, generator=g)), ("b", torch.randn(100, generator=g).to(torch.bfloat16))]


def _wait_offer(run_dir, step: int):
    deadline = time.monotonic() + 20
    while (offer := latest_offer(run_dir)) is None or offer.step != step:
        assert time.monotonic() < deadline, "no offer"
        time.sleep(0.01)  # polling a file another thread writes: the wait ends on the file, not on the clock
    return offer


def _serve(run_dir, secret, got, errors, step=1, offer=None):
    offer = offer or _wait_offer(run_dir, step)
    out: list = []
    try:
        wire.Receiver().receive(
            offer.init_info,
            offer.update_info,
            1,
            "cpu",
            lambda p: out.extend((n, t.clone()) for n, t in p),
            secret,
        )
        got.append(out)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        errors.append(e)


def test_a_stranger_cannot_list_read_or_write_keys(tmp_path):
    server = rendezvous.StoreServer("127.0.0.1", 0, SECRET)
    try:
        member = rendezvous.connect_store("127.0.0.1", server.port, SECRET, 5.0)
        member.set("group/x//0/0", b"rank0-address")
        # torch's own TCPStore client (what the stranger used): the challenge is not its protocol
        with pytest.raises(Exception):  # noqa: B017, PT011 - any failure to talk is what is wanted
            s = torch.distributed.TCPStore(
                "127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=3)
            )
            s.list_keys()
        # a client that knows the protocol but not the secret
        with pytest.raises(rendezvous.RendezvousAuthError):
            rendezvous.connect_store("127.0.0.1", server.port, "a-guess", 5.0)
        # raw bytes: a request frame in place of the challenge answer reads nothing back
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            raw.recv(64)
            raw.sendall(b"\x00\x00\x00\x10" + b'{"op":"num_keys"}'.ljust(60))
            assert raw.recv(4096) == b""
        assert server.refused >= 2
        assert member.get("group/x//0/0") == b"rank0-address"  # nobody re-registered rank 0
        assert member.num_keys() == 1
    finally:
        server.close()


def _until(condition, within_s: float) -> bool:
    """Poll `condition` until it holds or `within_s` passed (a bound, not a synchronization delay)."""
    import time

    end = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _store_threads() -> set:
    """The live connection threads of every store in this process (other tests' stores included: compare sets,
    since one of theirs may end during a test)."""
    import threading

    return {t for t in threading.enumerate() if t.name == "pjx-store-conn"}


def test_idle_strangers_hold_a_bounded_number_of_threads_and_a_member_still_joins():
    """Issue 48: one thread per unauthenticated connection, uncapped (2,000 idle connections -> 1,437 threads).
    At most MAX_PENDING challenges run at once; a newer connection evicts the oldest pending one."""
    server = rendezvous.StoreServer("127.0.0.1", 0, SECRET)
    idle = []
    try:
        before = _store_threads()
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        assert _until(lambda: server.evicted == 300 - rendezvous.MAX_PENDING, 10), server.evicted
        assert _until(lambda: len(_store_threads() - before) <= rendezvous.MAX_PENDING, 10), _store_threads()
        member = rendezvous.connect_store("127.0.0.1", server.port, SECRET, 5.0)
        member.set("k", b"v")
        assert member.get("k") == b"v"
    finally:
        for s in idle:
            s.close()
        server.close()


def test_a_challenge_answered_byte_by_byte_is_cut_off_at_the_deadline(monkeypatch):
    """The handshake's deadline covers the whole challenge, not each read (a peer sending one byte per
    interval under the per-read timeout kept its thread forever)."""
    monkeypatch.setattr(rendezvous, "HANDSHAKE_S", 0.5)
    before = _store_threads()
    server = rendezvous.StoreServer("127.0.0.1", 0, SECRET)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            raw.recv(64)
            sent = 0
            try:
                for _ in range(64):  # the full answer is 64 bytes: 6.4 s at this pace
                    raw.sendall(b"x")
                    sent += 1
                    time.sleep(0.1)  # the peer's pace (what is tested), not a synchronization
            except OSError:
                pass
            assert sent < 64 and (sent == 0 or raw.recv(1) == b"")
        assert _until(lambda: not _store_threads() - before, 5)  # its thread ended
    finally:
        server.close()


def test_the_store_binds_only_the_configured_address():
    server = rendezvous.StoreServer("127.0.0.1", 0, SECRET)
    try:
        # 127.0.0.2 is this host's loopback too: a socket bound to every interface would accept it
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", server.port), timeout=3).close()
        socket.create_connection(("127.0.0.1", server.port), timeout=3).close()
    finally:
        server.close()


def test_a_receiver_refuses_an_impostor_store():
    impostor = rendezvous.StoreServer("127.0.0.1", 0, "not-the-run-secret")
    try:
        with pytest.raises(rendezvous.RendezvousAuthError):
            rendezvous.connect_store("127.0.0.1", impostor.port, SECRET, 5.0)
    finally:
        impostor.close()


def test_a_stranger_receives_no_weights_and_the_run_still_transfers(tmp_path):
    """The stranger tries the round's offer while the sender waits for its receivers (before the member joins:
    once the round ends the offer is gone, and a stranger scheduled late would find nothing to try)."""
    sender = CollectiveSender(tmp_path, secret=SECRET, timeout_s=10, bucket_bytes=256)
    got, errors, sent = [], [], []
    sending = threading.Thread(target=lambda: sent.append(sender.send(1, _named())))
    sending.start()
    _serve(tmp_path, "a-guess", got, errors, offer=_wait_offer(tmp_path, 1))  # the stranger, on this thread
    member = threading.Thread(target=_serve, args=(tmp_path, SECRET, got, errors))
    member.start()
    sending.join(30)
    member.join(30)
    assert sent == [True]
    assert len(got) == 1 and len(errors) == 1
    assert isinstance(errors[0], rendezvous.RendezvousAuthError)
    for (_, a), (_, b) in zip(got[0], _named(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_bytes_that_differ_from_the_senders_digest_are_not_acknowledged(tmp_path, monkeypatch):
    """The sender publishes its digest after the last bucket; a receiver whose bytes hash differently (here:
    the wire altered one byte of the first bucket on the way in) raises and never acknowledges, so the
    sender reports the round failed (and the trainer falls back to the filesystem)."""
    real_receive = wire.receive_lanes

    def tampered(groups, metas, update_info, bucket_bytes, device, load, digests):
        group = groups[0]
        real_broadcast = group.broadcast
        first = [True]

        def broadcast(tensor, src=0):
            real_broadcast(tensor, src)
            if first[0]:
                tensor[0] ^= 1
                first[0] = False

        group.broadcast = broadcast
        try:
            return real_receive(groups, metas, update_info, bucket_bytes, device, load, digests)
        finally:
            group.broadcast = real_broadcast

    monkeypatch.setattr(wire, "receive_lanes", tampered)
    sender = CollectiveSender(tmp_path, secret=SECRET, timeout_s=3, bucket_bytes=256)
    got, errors = [], []
    t = threading.Thread(target=_serve, args=(tmp_path, SECRET, got, errors))
    t.start()
    assert sender.send(1, _named()) is False
    t.join(20)
    assert not got and len(errors) == 1 and "digest mismatch" in str(errors[0])
