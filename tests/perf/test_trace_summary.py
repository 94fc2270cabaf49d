"""The profile summary's span arithmetic (tools/bench_trainer_profile.py): the GPU rows' "NCCL with no compute beside
it", idle time and host-copy overlap in docs/benchmarks.md come from these functions."""

from __future__ import annotations

from tools.bench_trainer_profile import _busy, _copy_overlap

MS = 10**6  # spans are in ns


def test_exposed_nccl_idle_and_window_per_gpu():
    # compute 0-10 and 20-30 ms; an all-gather 5-25 (10 ms of it alone), a reduce-scatter 32-34 (all alone)
    spans = {"/device:GPU:0": {"compute": [(20 * MS, 30 * MS), (0, 10 * MS)], "nccl": [(5 * MS, 25 * MS), (32 * MS, 34 * MS)]}}
    collectives = {
        "/device:GPU:0": [(32 * MS, 34 * MS, "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"),
                          (5 * MS, 25 * MS, "ncclDevKernel_AllGather_RING_LL")],
    }  # fmt: skip
    got = _busy(spans, collectives, steps=2)["/device:GPU:0"]
    assert got["window_ms"] == 17.0  # 34 ms over 2 steps
    assert got["compute_ms"] == 10.0 and got["nccl_ms"] == 11.0
    assert got["nccl_exposed_ms"] == 6.0  # (10 + 2) / 2
    assert got["idle_ms"] == 1.0  # 30-32 ms, nothing ran
    by = got["nccl_exposed_by_kernel"]
    assert by["ncclDevKernel_AllGather_RING_LL"] == [10.0, 5.0, round(5 / 34, 2)]
    assert list(by)[0] == "ncclDevKernel_AllGather_RING_LL"  # most exposed first
    assert got["nccl_timeline"] == [[5.0, 20.0, 10.0, "AllGather_RING_LL"], [32.0, 2.0, 2.0, "ReduceScatter_Sum_bf16_RING_LL"]]


def test_host_copies_overlap_counts_time_both_directions_run():
    copies = {"/device:GPU:0": {"h2d": [(0, 10 * MS, "s1"), (5 * MS, 12 * MS, "s2")], "d2h": [(8 * MS, 20 * MS, "s1")]}}
    got = _copy_overlap(copies, steps=1)["/device:GPU:0"]
    assert got["h2d_ms"] == 12.0 and got["d2h_ms"] == 12.0 and got["both_ms"] == 4.0
    assert got["streams"] == {"h2d": ["s1", "s2"], "d2h": ["s1"]}
