"""A node's layout (primejax/launcher/placement.py): shared GPU, split GPUs, what is refused."""

from __future__ import annotations

import pytest

from primejax.launcher.placement import (
    SHARED_MAX_TOTAL,
    PlacementError,
    node_gpu_count,
    plan,
)


def test_cpu_node_places_nothing():
    p = plan(0, "", "")
    assert p.node_gpus == 0 and not p.shared and p.trainer_devices == "" and p.inference_devices == ""


def test_one_gpu_is_shared_with_its_memory_split():
    p = plan(1, "", "")
    assert p.shared and p.trainer_devices == p.inference_devices == "0"
    assert p.trainer_memory_fraction == 0.45 and p.inference_memory_fraction == 0.45
    assert p.trainer_memory_fraction + p.inference_memory_fraction <= SHARED_MAX_TOTAL
    # Named and equal: shared too, the user's fractions kept.
    p = plan(4, "2", "2", trainer_memory_fraction=0.3, inference_memory_fraction=0.6)
    assert (
        p.shared
        and p.trainer_devices == "2"
        and (p.trainer_memory_fraction, p.inference_memory_fraction) == (0.3, 0.6)
    )


def test_shared_fractions_that_do_not_fit_are_refused_naming_the_key():
    with pytest.raises(PlacementError, match="inference.gpu_memory_utilization") as e:
        plan(1, "", "", inference_memory_fraction=0.6)
    assert "\n" not in str(e.value)


def test_several_gpus_split_servers_last_trainer_first():
    p = plan(4, "", "", replicas=2)
    assert not p.shared and p.trainer_devices == "0,1" and p.inference_devices == "2,3"
    assert p.inference_memory_fraction == 0.85 and p.trainer_memory_fraction == 0.0
    p = plan(4, "", "", replicas=1, tensor_parallel=2)
    assert p.trainer_devices == "0,1" and p.inference_devices == "2,3"
    p = plan(2, "", "")
    assert p.trainer_devices == "0" and p.inference_devices == "1"


@pytest.mark.parametrize(
    "args, kw, key",
    [
        ((4, "", ""), dict(replicas=4), "inference.devices"),  # no GPU left for the trainer
        ((4, "0,1", "1,2"), {}, "trainer.devices"),  # partial overlap
        ((4, "0,1", ""), {}, "inference.devices"),  # one named, the other sees everything
        ((2, "0", "3"), {}, "inference.devices"),  # no GPU 3 on this node
        ((4, "0,1", "2,3"), dict(replicas=2, tensor_parallel=2), "inference.devices"),  # 2 GPUs for 4
        ((2, "0,1", "0,1"), dict(replicas=2), "inference.replicas"),  # a shared set serves one replica
    ],
)
def test_layouts_that_cannot_work_are_refused_naming_the_key(args, kw, key):
    with pytest.raises(PlacementError) as e:
        plan(*args, **kw)
    assert e.value.key == key and "\n" not in str(e.value)


def test_inference_off_places_only_the_trainer():
    p = plan(4, "0,1", "", inference_enabled=False)
    assert p.trainer_devices == "0,1" and not p.shared


def test_node_gpu_count_reads_cuda_visible_devices_first():
    assert node_gpu_count({"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    assert node_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert node_gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}) == 0


def test_ids_count_the_launchers_own_gpus_and_children_get_the_nodes_ids():
    """Under CUDA_VISIBLE_DEVICES=2,3 a child told '0' would see the node's GPU 0, not the launcher's first GPU."""
    p = plan(2, "", "", visible="2,3")
    assert (p.trainer_devices, p.inference_devices) == ("2", "3")
    p = plan(1, "", "", visible="3")
    assert p.shared and p.trainer_devices == p.inference_devices == "3"
    p = plan(4, "0,1", "2,3", replicas=2, visible="4,5,6,7")
    assert (p.trainer_devices, p.inference_devices) == ("4,5", "6,7")
    assert plan(2, "", "").trainer_devices == "0"  # no CUDA_VISIBLE_DEVICES: the node's ids already
    with pytest.raises(PlacementError, match="non-numeric"):
        plan(2, "", "", visible="GPU-aaaa,GPU-bbbb")
