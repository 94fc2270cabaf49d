"""A GPU node's layout (utils/devices.py): each process sees only its GPUs, bad layouts fail with one line."""

from __future__ import annotations

import pytest

from primejax.config import ConfigError, default_config, validate
from primejax.launcher.launch import _child_env
from primejax.utils.devices import accelerator_env, check_layout, parse_devices


def test_parse_devices():
    assert parse_devices("", "k") == []
    assert parse_devices("1, 3", "k") == [1, 3]
    with pytest.raises(ValueError, match="trainer.devices: expected"):
        parse_devices("gpu1", "trainer.devices")
    with pytest.raises(ValueError, match="distinct"):
        parse_devices("1,1", "inference.devices")


def test_layout_both_or_neither_and_disjoint():
    check_layout("", "")
    check_layout("1,2,3", "0")
    check_layout("0", "", inference_enabled=False)  # no launched server: nothing to keep apart
    with pytest.raises(ValueError, match="^inference.devices: must be set too"):
        check_layout("1", "")
    with pytest.raises(ValueError, match="^trainer.devices: must be set too"):
        check_layout("", "0")
    with pytest.raises(ValueError, match=r"^trainer.devices: \[1\] also in inference.devices"):
        check_layout("1,2", "0,1")


def test_config_validation_names_the_key():
    c = default_config()
    c.model.path = "/models/m"
    c.trainer.devices = "0,1"
    c.inference.devices = "1"
    with pytest.raises(ConfigError, match="trainer.devices") as e:
        validate(c)
    assert e.value.key == "trainer.devices"
    c = default_config()
    c.model.path = "/models/m"
    c.trainer.memory_fraction = 1.5
    with pytest.raises(ConfigError, match="trainer.memory_fraction"):
        validate(c)


def test_child_env_gives_only_its_devices_and_bounds_jax():
    env = _child_env("1", platform_cpu=False, memory_fraction=0.5)
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in _child_env("1", platform_cpu=False)  # 0: JAX's default
    # The trainer process started by hand: the user's environment wins over the config.
    assert accelerator_env("1", 0.3, {"CUDA_VISIBLE_DEVICES": "2"}) == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"
    }
