"""Wire version 2 (issue 47): runs of equal tensors travel as stacks; the manifest and the version are checked.

No server: CollectiveSender -> wire.Receiver over gloo in one process (a thread), as test_transfer_wire.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from primejax.transports.weights.collective import meta, wire
from primejax.transports.weights.collective.offer import latest_offer
from primejax.transports.weights.collective.sender import CollectiveSender, tensor_metas

SECRET = "the-run-secret"


def _moe_like(seed: int) -> list[tuple[str, torch.Tensor]]:
    """An MoE-shaped round in the export's order: a dense tensor, 2 layers x 6 experts of one projection (equal
    shapes: stacks that cross a layer and a bucket), an odd one, a bf16 run."""
    g = torch.Generator().manual_seed(seed)
    out = [("model.embed_tokens.weight", torch.randn(11, 8, generator=g))]
    out += [
        (f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight", torch.randn(4, 8, generator=g))
        for layer in range(2)
        for e in range(6)
    ]
    out += [("model.norm.weight", torch.randn(8, generator=g))]
    out += [
        (f"model.layers.{i}.input_layernorm.weight", torch.randn(8, generator=g).bfloat16()) for i in range(3)
    ]
    return out


class Recorder:
    """A loader with a `stacked` hook (as fused.ExpertLoader): what arrived, and how."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.stacks: list[tuple[list[str], int]] = []

    def __call__(self, pairs) -> None:
        self.tensors.update((n, t.clone()) for n, t in pairs)

    def stacked(self, names, t) -> None:
        assert t.shape[0] == len(names) and t._base is not None  # a view of the bucket, not a copy
        self.stacks.append((list(names), t.shape[0]))
        self.tensors.update((n, x.clone()) for n, x in zip(names, t.unbind(0), strict=True))


def _round(tmp_path, named, items, *, stacks: bool, load, bucket_bytes: int = 600) -> dict:
    sender = CollectiveSender(tmp_path, secret=SECRET, timeout_s=10, bucket_bytes=bucket_bytes, stacks=stacks)
    out: dict = {}

    def serve():
        deadline = time.monotonic() + 10
        while (offer := latest_offer(tmp_path)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        out["info"] = offer.update_info
        out["bytes"] = wire.Receiver().receive(offer.init_info, offer.update_info, 1, "cpu", load, SECRET)

    t = threading.Thread(target=serve)
    t.start()
    out["ok"] = sender.send_lazy(1, tensor_metas(named), items)
    t.join(20)
    return out


@pytest.mark.parametrize("stacked_items", [False, True])
def test_a_stacked_round_delivers_the_bytes_of_the_per_tensor_round(tmp_path, stacked_items):
    """The same tensors with and without stacks arrive bit for bit the same; with stacks the receiver gets the
    runs as [count, ...] views (several per round, crossing a layer), whether the sender hands them over tensor
    by tensor or as stacked runs (device.py's items, here cut across buckets)."""
    named = _moe_like(0)
    metas = tensor_metas(named)
    items = [t for _, t in named]
    if stacked_items:  # the 12 expert tensors as two runs of 5 and 7, the 3 norms as one
        experts = [t for _, t in named[1:13]]
        items = [
            items[0],
            torch.stack(experts[:5]),
            torch.stack(experts[5:]),
            items[13],
            torch.stack(items[14:]),
        ]
    plain, stacked = Recorder(), Recorder()
    a = _round(tmp_path / "a", named, iter([t for _, t in named]), stacks=False, load=plain)
    b = _round(tmp_path / "b", named, iter(items), stacks=True, load=stacked)
    assert a["ok"] and b["ok"] and a["bytes"] == b["bytes"] == sum(m.nbytes for m in metas)
    assert a["info"]["stacks"] == [] and not plain.stacks
    assert b["info"]["stacks"] == [[1, 4], [5, 4], [9, 4], [14, 3]]  # cut at the bucket size, across a layer
    assert stacked.stacks and all(n > 1 for _, n in stacked.stacks)
    assert [n for n, _ in named] == list(plain.tensors) == list(stacked.tensors)
    for n, t in named:
        assert torch.equal(plain.tensors[n].view(torch.uint8), t.view(torch.uint8)), n
        assert torch.equal(stacked.tensors[n].view(torch.uint8), t.view(torch.uint8)), n


def test_a_loader_without_a_stack_hook_gets_every_tensor_by_name(tmp_path):
    named = _moe_like(1)
    got: dict[str, torch.Tensor] = {}
    r = _round(
        tmp_path,
        named,
        iter([t for _, t in named]),
        stacks=True,
        load=lambda p: got.update((n, t.clone()) for n, t in p),
    )
    assert r["ok"] and r["info"]["stacks"]
    assert all(torch.equal(got[n], t) for n, t in named) and list(got) == [n for n, _ in named]


def test_make_stacks_cuts_runs_at_the_bucket_size_and_never_mixes_shapes():
    metas = tensor_metas(_moe_like(0))  # 12 expert tensors of 128 bytes from index 1
    assert meta.make_stacks(metas, 10**9) == [(1, 12), (14, 3)]
    assert meta.make_stacks(metas, 512) == [(1, 4), (5, 4), (9, 4), (14, 3)]
    assert meta.make_stacks(metas, 1) == []  # one tensor per stack: no stacks
    units = meta.stacks_of({"stacks": [[1, 12], [14, 3]]}, metas)
    assert units == [(0, 1), (1, 12), (13, 1), (14, 3)]


def _info(stacks):
    named = _moe_like(0)
    return {**meta.update_info("r", tensor_metas(named)), "stacks": stacks}


@pytest.mark.parametrize(
    ("stacks", "match"),
    [
        ([[14, 5]], "outside"),  # past the round's 17 tensors
        ([[-1, 3]], "outside"),
        ([[1, 4], [3, 4]], "overlaps"),
        ([[5, 4], [1, 4]], "out of order"),
        ([[1, 1]], "shorter than 2"),
        ([[1, 10**12]], "outside"),  # a huge count
        ([[1, 2]] * 9, "at most 8"),  # more stacks than half the tensors
        ([[0, 2]], "mixes dtypes or shapes"),
        ([[13, 2]], "mixes dtypes or shapes"),  # fp32 norm + bf16 norm
        ([[1, "3"]], "malformed"),
        ([[1, True]], "malformed"),
        ([[1, 2.0]], "malformed"),
        ("1,12", "must be a list"),
    ],
)
def test_a_manifest_that_lies_is_refused_in_one_line(stacks, match):
    """Before the server pauses (the route's check runs lanes.pieces_of) and before a receiver joins."""
    from primejax.transports.weights.collective.lanes import pieces_of

    info = _info(stacks)
    with pytest.raises(ValueError, match=match) as e:
        pieces_of(info, meta.metas_from_update_info(info))
    assert "\n" not in str(e.value) and len(str(e.value)) < 300
    with pytest.raises(ValueError, match=match):  # the receiver refuses it without joining the group
        wire.Receiver().receive(
            {"master_address": "127.0.0.1", "master_port": 1, "group_id": "g", "world_size": 2},
            info,
            1,
            "cpu",
            lambda pairs: None,
            SECRET,
        )


def test_stacks_with_pieces_are_refused():
    info = {**_info([[1, 2]]), "senders": 2, "pieces": [[i, 0, 0, 1] for i in range(17)]}
    with pytest.raises(ValueError, match="with 'pieces'"):
        meta.stacks_of(info, meta.metas_from_update_info(info))


@pytest.mark.parametrize("version", [None, 1, 3, "2"])
def test_a_peer_speaking_another_wire_version_is_refused_in_one_line(version):
    info = meta.update_info("r", tensor_metas(_moe_like(0)))
    if version is None:
        del info["wire_version"]  # a sender from before issue 47
    else:
        info["wire_version"] = version
    with pytest.raises(ValueError, match=r"weight-wire version .* this side version 2") as e:
        meta.metas_from_update_info(info)
    assert "\n" not in str(e.value)
