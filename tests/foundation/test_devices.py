"""A GPU node's layout (utils/devices.py): each process sees only its GPUs, bad layouts fail with one line."""

from __future__ import annotations

import pytest

from primejax.config import ConfigError, default_config, validate
from primejax.launcher.children import child_env
from primejax.utils.devices import (
    PINNED_HOST_LIMIT_ENV,
    accelerator_env,
    check_host_memory,
    check_layout,
    host_memory_available,
    local_gpu_count,
    parse_devices,
    pinned_host_env,
)


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
    env = child_env("1", platform_cpu=False, memory_fraction=0.5)
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in child_env("1", platform_cpu=False)  # 0: JAX's default
    # The trainer process started by hand: the user's environment wins over the config.
    assert accelerator_env("1", 0.3, {"CUDA_VISIBLE_DEVICES": "2"}) == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"
    }


def test_pinned_host_cap_is_each_devices_share_of_the_offloaded_state():
    """XLA's GPU client caps each device's pinned-host pool at 64 GiB unless told; an offloaded run needs its
    share of 12 B/param (92 GB per GPU for Qwen3-30B-A3B on 4), and a cap far above that let the allocator's
    doubling regions outgrow the host (docs/memory.md). The cap: share + 15% + 8 GiB; the user's value wins."""
    state = 12 * 30.5e9
    share_gib = state / 4 / 2**30
    cap = float(pinned_host_env(state, 4, {})[PINNED_HOST_LIMIT_ENV])
    assert share_gib * 1.15 + 7 <= cap <= share_gib * 1.15 + 8 and cap > 64
    assert pinned_host_env(state, 4, {PINNED_HOST_LIMIT_ENV: "200"}) == {}
    assert pinned_host_env(state, 0, {}) == {}  # no GPU seen: nothing to cap


def test_local_gpu_count_from_the_trainers_devices_or_the_environment():
    assert local_gpu_count("0,2,3", {"CUDA_VISIBLE_DEVICES": "0"}) == 3
    assert local_gpu_count("", {"CUDA_VISIBLE_DEVICES": "1,2"}) == 2


def test_offloaded_trainer_sets_the_cap_from_the_model(tiny_model_dir, monkeypatch):
    """The trainer entry point computes the cap before JAX starts: the model's parameters from its config.json,
    over trainer.devices x processes (PRIMEJAX_NUM_PROCESSES overriding the config, as for the run)."""
    from primejax.config import typed
    from primejax.entrypoints.trainer import _pinned_host_env, offloaded_state_bytes
    from primejax.models.config import ModelConfig

    monkeypatch.delenv(PINNED_HOST_LIMIT_ENV, raising=False)
    c = default_config()
    c.model.path = str(tiny_model_dir)
    c.trainer.devices, c.inference.devices = "0,1", "2"
    c.trainer.optim.offload = True
    params = ModelConfig.from_model_dir(tiny_model_dir).num_params()
    assert _pinned_host_env(typed(c)) == pinned_host_env(12 * params, 2, {})
    monkeypatch.setenv("PRIMEJAX_NUM_PROCESSES", "4")  # 4 hosts (or processes) of 2 GPUs each
    assert _pinned_host_env(typed(c)) == pinned_host_env(12 * params, 8, {})
    assert offloaded_state_bytes(typed(c)) == 12 * params
    c.trainer.optim.offload_master = False  # the master stays on the devices: only the moments in host memory
    assert offloaded_state_bytes(typed(c)) == 8 * params
    c.trainer.optim.offload_resident_gib = 1e-5  # what each of the 8 devices keeps is not in host memory
    resident = int(1e-5 * 2**30)
    assert 0 < 8 * resident < 8 * params
    assert offloaded_state_bytes(typed(c), 8) == 8 * params - 8 * resident
    assert offloaded_state_bytes(typed(c)) == 8 * params


def test_a_host_without_the_memory_for_its_offloaded_share_fails_in_one_line(tmp_path):
    """Before minutes of pinning end in CUDA_ERROR_OUT_OF_MEMORY: this host's share (its GPUs of all) of 12
    B/param against MemAvailable."""
    from primejax.utils.sections import ConfigError

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       527000000 kB\nMemAvailable:   500000000 kB\n")
    available = host_memory_available(str(meminfo))
    assert available == 500000000 * 1024
    state = 12 * 235e9  # Qwen3-235B-A22B: 2.8 TB
    with pytest.raises(ConfigError, match=r"^trainer.optim.offload: this host's 4 GPU\(s\) need 2626 GiB"):
        check_host_memory(state, 4, 4, available)
    check_host_memory(state, 4, 32, available)  # 8 hosts of 4 GPUs: 328 GiB here, it fits
    check_host_memory(state, 0, 4, available)  # no GPU here (CPU runs keep the state in ordinary memory)
    assert host_memory_available(str(tmp_path / "missing")) == 0
