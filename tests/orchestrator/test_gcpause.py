"""The orchestrator's garbage-collector policy (primejax/orchestrator/gcpause.py): survivors leave the collected
generations, automatic full collections are off, cycles are freed by the periodic full collection, and the
process's collector is as it was after the run."""

from __future__ import annotations

import gc
import weakref

from primejax.orchestrator.gcpause import NEVER, GcPolicy


class Node:
    def __init__(self) -> None:
        self.other = None


def _cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_survivors_are_frozen_full_collections_free_cycles_and_stop_restores():
    before = gc.get_threshold()
    policy = GcPolicy(freeze=True, full_every=3)
    policy.start()
    try:
        assert gc.get_threshold()[2] == NEVER and gc.get_threshold()[:2] == before[:2]
        frozen = gc.get_freeze_count()
        assert frozen > 0
        live = [Node() for _ in range(1000)]  # what a step leaves in flight
        m = policy.after_step(1)
        assert m["gc/frozen"] >= frozen + 1000 and "gc/full_s" not in m
        ref = _cycle()  # garbage in a cycle, frozen at the next step: no collection can see it there
        policy.after_step(2)
        gc.collect()
        assert ref() is not None
        m = policy.after_step(3)  # the periodic full collection unfreezes and collects everything
        assert ref() is None and m["gc/full_s"] >= 0.0
        assert m["gc/collections"] >= 0 and m["gc/pause_max_s"] >= 0.0
        del live
    finally:
        policy.stop()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert policy._callback not in gc.callbacks


def test_disabled_policy_leaves_the_collector_alone():
    before = gc.get_threshold()
    policy = GcPolicy(freeze=False)
    policy.start()
    try:
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        m = policy.after_step(1)
        assert "gc/frozen" not in m and gc.get_freeze_count() == 0
    finally:
        policy.stop()
    assert gc.get_threshold() == before
