"""Several senders, one round (primejax.transports.weights.collective.lanes): the pieces' checks, the schedule, and a gloo round of
two senders (each holding half of every tensor's rows, as two trainer processes do) to two receivers."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from primejax.transports.weights.collective import lanes, meta, wire
from primejax.transports.weights.collective.lanes import Piece
from primejax.transports.weights.collective.offer import latest_offer
from primejax.transports.weights.collective.sender import CollectiveSender, tensor_metas

SECRET = "the-run-secret"


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 5), (300,), (16, 16, 3), (1,), (64, 33)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]
    return [
        (f"t{i}", torch.randn(s, generator=g).to(d))
        for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))
    ]


def _pieces(named) -> list[Piece]:
    """Rows split in two halves (sender 0 the first, sender 1 the second); a one-row tensor whole from sender 1."""
    out = []
    for i, (_, t) in enumerate(named):
        n = t.shape[0]
        if n == 1:
            out.append(Piece(i, 1, 0, 1))
        else:
            out += [Piece(i, 0, 0, n // 2), Piece(i, 1, n // 2, n)]
    return out


def _info(named, pieces, senders=2):
    info = meta.update_info("r", tensor_metas(named))
    info.update(senders=senders, pieces=[[p.tensor, p.sender, p.start, p.stop] for p in pieces])
    return info


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda ps: ps[:-1], "do not cover"),  # a missing block
        (lambda ps: [*ps, ps[0]], "do not cover"),  # a block twice
        (lambda ps: [[0, 0, 0, 99], *ps[1:]], "outside t0"),
        (lambda ps: [[0, 5, 0, 4], *ps[1:]], "names no tensor or sender"),
        (lambda ps: [[0, 0, "a", 4], *ps[1:]], "malformed piece"),
    ],
)
def test_pieces_that_miss_overlap_or_exceed_rows_are_refused(edit, match):
    named = _named(0)
    info = _info(named, _pieces(named))
    info["pieces"] = edit(info["pieces"])
    with pytest.raises(ValueError, match=match):
        lanes.pieces_of(info, tensor_metas(named))


def test_without_pieces_every_tensor_is_one_piece_of_sender_0():
    named = _named(0)
    senders, pieces = lanes.pieces_of(meta.update_info("r", tensor_metas(named)), tensor_metas(named))
    assert senders == 1 and pieces == [Piece(i, 0, 0, t.shape[0]) for i, (_, t) in enumerate(named)]


def test_schedule_takes_the_lanes_round_robin():
    assert lanes.schedule([[0, 1, 2], [0], []]) == [(0, 0), (1, 0), (0, 1), (0, 2)]


def test_two_senders_two_receivers_bit_exact_over_two_rounds(tmp_path):
    """Sender 0 hosts the store and writes the offer; sender 1 sends its halves over its own lane. Both
    receivers assemble every tensor whole and bit-exact, every sender sees the round acknowledged, and the
    second round reuses both lanes' groups."""
    rounds = [_named(1), _named(2)]
    s0 = CollectiveSender(tmp_path, secret=SECRET, timeout_s=20, bucket_bytes=300, num_receivers=2, senders=2)
    s1 = CollectiveSender(
        tmp_path,
        secret=SECRET,
        port=s0.port,
        timeout_s=20,
        bucket_bytes=300,
        num_receivers=2,
        lane=1,
        senders=2,
    )
    got: dict[int, list] = {1: [], 2: []}
    groups: dict[int, list] = {1: [], 2: []}
    errors: list[BaseException] = []

    def receive(rank: int) -> None:
        rx = wire.Receiver()
        try:
            for step in (1, 2):
                deadline = time.monotonic() + 20
                while (offer := latest_offer(tmp_path)) is None or offer.step != step:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                out: list = []
                rx.receive(
                    offer.init_info,
                    offer.update_info,
                    rank,
                    "cpu",
                    lambda pairs, out=out: out.extend((n, t.clone()) for n, t in pairs),
                    SECRET,
                )
                got[rank].append(dict(out))
                groups[rank].append(list(rx.groups or []))
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    def send1(results: list) -> None:
        for step, named in zip((1, 2), rounds, strict=True):
            pieces = _pieces(named)
            mine = (named[p.tensor][1][p.start : p.stop] for p in pieces if p.sender == 1)
            results.append(
                s1.send_lazy(step, tensor_metas(named), mine, pieces=pieces, ids=("g1", f"{step}-x"))
            )

    threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
    results1: list = []
    threads.append(threading.Thread(target=send1, args=(results1,)))
    for t in threads:
        t.start()
    results0 = []
    for step, named in zip((1, 2), rounds, strict=True):
        pieces = _pieces(named)
        mine = (named[p.tensor][1][p.start : p.stop] for p in pieces if p.sender == 0)
        results0.append(s0.send_lazy(step, tensor_metas(named), mine, pieces=pieces, ids=("g1", f"{step}-x")))
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results0 == results1 == [True, True]
    for rank in (1, 2):
        assert all(a is b for a, b in zip(*groups[rank], strict=True)) and len(groups[rank][0]) == 2
        for named, out in zip(rounds, got[rank], strict=True):
            assert sorted(out) == sorted(n for n, _ in named)
            for name, t in named:
                assert out[name].dtype == t.dtype and out[name].shape == t.shape
                assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name
    assert s1.last["transfer/gb"] > 0 and s0.last["transfer/gb"] > 0


def test_a_sender_that_never_sends_fails_the_round_for_every_sender_and_receiver(tmp_path):
    """Sender 1 of 2 never joins (a dead trainer process): each receiver's round raises (nothing is
    acknowledged, so a server restores or reports unhealthy) and sender 0 reports failure (the fallback) after its
    timeout instead of hanging."""
    named = _named(3)
    pieces = _pieces(named)
    s0 = CollectiveSender(tmp_path, secret=SECRET, timeout_s=3, bucket_bytes=300, num_receivers=2, senders=2)
    errors: list[BaseException] = []

    def receive(rank: int) -> None:
        deadline = time.monotonic() + 20
        while (offer := latest_offer(tmp_path)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        try:
            wire.Receiver().receive(
                offer.init_info, offer.update_info, rank, "cpu", lambda pairs: None, SECRET
            )
        except BaseException as e:  # noqa: BLE001 - the expected failure, checked below
            errors.append(e)

    threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    mine = (named[p.tensor][1][p.start : p.stop] for p in pieces if p.sender == 0)
    assert s0.send_lazy(1, tensor_metas(named), mine, pieces=pieces, ids=("g2", "1-y")) is False
    assert time.monotonic() - t0 < 30
    for t in threads:
        t.join(30)
    assert len(errors) == 2
    assert latest_offer(tmp_path) is None
