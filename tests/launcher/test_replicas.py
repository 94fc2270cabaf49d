"""inference.replicas: one spec per server (ports, device groups), checked before anything starts."""

from __future__ import annotations

import socket

import pytest

from primejax.inference.server import InferenceConfig
from primejax.launcher.preflight import PreflightError
from primejax.launcher.replicas import replica_specs, split_devices


def test_devices_split_evenly_in_consecutive_groups_and_an_uneven_split_is_one_clear_error():
    assert split_devices("0,1,2,3", 2) == ["0,1", "2,3"]
    assert split_devices("", 3) == ["", "", ""]
    with pytest.raises(PreflightError, match="inference.devices"):
        split_devices("0,1,2", 2)


def test_replicas_get_distinct_free_ports_and_their_own_names():
    specs = replica_specs(InferenceConfig(port=0, replicas=3, devices="0,1,2"))
    assert [s.name for s in specs] == ["inference", "inference_1", "inference_2"]
    assert len({s.port for s in specs}) == 3 and [s.devices for s in specs] == ["0", "1", "2"]
    assert specs[1].url == f"http://127.0.0.1:{specs[1].port}"


def test_a_taken_replica_port_is_refused_before_anything_starts():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PreflightError, match="already in use"):
            replica_specs(InferenceConfig(port=port - 1, replicas=2))
