"""The collective wire protocol without a server: bucket cuts, a gloo round trip, the sender's timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from primejax.config import ConfigError, default_config, validate
from primejax.transports.weights.collective import meta, wire
from primejax.transports.weights.collective.offer import latest_offer
from primejax.transports.weights.collective.sender import CollectiveSender, tensor_metas, to_torch

SECRET = "the-run-secret"


def _named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (300,), (16, 16, 3), (1,), (64, 33)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]
    return [
        (f"t{i}", torch.randn(s, generator=g).to(d))
        for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))
    ]


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
@pytest.mark.parametrize("bucket_bytes", [1, 100, 1000, 10**9])
def test_buckets_cut_where_vllm_packs(bucket_bytes):
    """Same cut rule as vLLM's packed NCCL broadcast (`pack_tensors`): both sides split identically."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    named = _named()
    it = iter(named)
    vllm_cuts = []
    while (chunk := pack_tensors(it, lambda item: item[1], bucket_bytes)) is not None:
        vllm_cuts.append(chunk.names)
    metas = tensor_metas(named)
    units = meta.stacks_of({}, metas)  # no stacks: every tensor its own unit
    ours = [[named[units[u][0]][0] for u in idx] for idx in meta.unit_buckets(metas, units, bucket_bytes)]
    assert ours == vllm_cuts


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_gloo_rounds_are_bit_exact_acknowledged_and_reuse_the_group(tmp_path, device):
    """Two rounds through CollectiveSender -> wire.Receiver (the engine's receive path): every byte arrives,
    both rounds are acknowledged, and the second round reuses the first round's group (no new rendezvous).
    `meta`: a receiver whose own device gloo cannot fill (a GPU vLLM worker's) still receives into host memory."""
    from primejax.transports.weights.collective.offer import latest_offer

    rounds = [_named(1), _named(2)]
    sender = CollectiveSender(tmp_path, secret=SECRET, timeout_s=10, bucket_bytes=256)
    receiver = wire.Receiver()
    got: list[list[tuple[str, torch.Tensor]]] = []
    groups = []

    def serve():
        for step in (1, 2):
            deadline = time.monotonic() + 10
            while (offer := latest_offer(tmp_path)) is None or offer.step != step:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            out: list[tuple[str, torch.Tensor]] = []
            receiver.receive(
                offer.init_info,
                offer.update_info,
                1,
                torch.device(device),
                lambda pairs, out=out: out.extend((n, t.clone()) for n, t in pairs),
                SECRET,
            )
            got.append(out)
            groups.append(receiver.group)

    t = threading.Thread(target=serve)
    t.start()
    assert sender.send(1, rounds[0]) and sender.send(2, rounds[1])
    t.join(20)
    assert groups[0] is groups[1] is not None
    for named, out in zip(rounds, got, strict=True):
        assert [n for n, _ in out] == [n for n, _ in named]
        for (_, a), (_, b) in zip(out, named, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert sender.last["transfer/gb"] == sum(m.nbytes for m in tensor_metas(rounds[1])) / 1e9


def test_send_refuses_a_tensor_that_disagrees_with_its_metadata():
    named = _named()
    metas = tensor_metas(named)
    bad = [x for _, x in named]
    bad[2] = bad[2].float()

    class NoGroup:
        def broadcast(self, tensor, src=0):
            pass

    with pytest.raises(ValueError, match="t2: got torch.float32"):
        wire.send(NoGroup(), bad, metas, 10**9)


def test_to_torch_keeps_bf16_bits():
    import ml_dtypes

    a = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    t = to_torch(a)
    assert t.dtype == torch.bfloat16 and t.shape == (3, 4)
    np.testing.assert_array_equal(t.float().numpy(), a.astype(np.float32))


def test_sender_without_receivers_gives_up_after_its_timeout_and_removes_the_offer(tmp_path):
    sender = CollectiveSender(tmp_path, secret=SECRET, timeout_s=1.5, bucket_bytes=1024)
    seen = {}

    def watch():
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "offer" not in seen:
            if (o := latest_offer(tmp_path)) is not None:
                seen["offer"] = o
            time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    t0 = time.monotonic()
    assert sender.send(3, _named()) is False
    assert time.monotonic() - t0 < 10
    t.join()
    offer = seen["offer"]
    assert (
        offer.step == 3
        and offer.init_info["master_port"] == sender.port
        and offer.init_info["world_size"] == 2
    )
    assert offer.update_info["names"] == [n for n, _ in _named()]
    assert latest_offer(tmp_path) is None


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("mode", "nccl", "trainer.broadcast.mode"),
        ("transfer_port", 70000, "trainer.broadcast.transfer_port"),
        ("transfer_timeout_s", 0.0, "trainer.broadcast.transfer_timeout_s"),
    ],
)
def test_config_rejects_bad_transfer_settings(key, value, match):
    c = default_config()
    c.model.path = "x"
    c.trainer.broadcast[key] = value
    with pytest.raises(ConfigError, match=match):
        validate(c)


def test_layers_per_call_is_the_largest_divisor_within_the_limit():
    from primejax.transports.weights.collective.device import layers_per_call

    # Qwen3-30B-A3B's experts' gate_proj in bf16: 128 x 768 x 2048 x 2 bytes = 403 MB a layer, 48 layers.
    assert layers_per_call(48, 128 * 768 * 2048 * 2, 1 << 30) == 2
    assert layers_per_call(48, 1, 1 << 30) == 48  # small layers: one call
    assert layers_per_call(61, 1 << 20, 1 << 24) == 1  # prime count: one layer a call rather than two shapes
    assert layers_per_call(36, 2 << 30, 1 << 30) == 1  # a layer over the limit still goes, alone


def _unstacked(items, metas) -> list[torch.Tensor]:
    """The tensors of `hf_device_tensors`'s items (a run of layers or experts comes stacked, one item)."""
    out: list[torch.Tensor] = []
    for t in items:
        m = metas[len(out)]
        out += [t] if tuple(t.shape) == m.shape else list(t.unbind(0))
    return out


@pytest.mark.parametrize("variant", ["tied", "untied", "moe"])
def test_device_tensors_equal_the_safetensors_export(variant, tmp_path):
    """The no-host-copy path (jitted HF conversion + DLPack) yields exactly the tensors the export writes, in
    its order (dense tied/untied, and Qwen3-MoE with a dense layer: per-expert tensors), whether a parameter
    converts all its layers in one call or one layer per call (a chunk limit below one layer's bytes)."""
    from primejax.models.config import ModelConfig
    from primejax.models.hf_io import load_model, state_to_hf_tensors
    from primejax.models.tiny import build_tiny_model
    from primejax.models.transformer import init_model
    from primejax.transports.weights.collective.device import hf_device_tensors

    if variant == "moe":
        cfg = ModelConfig(
            model_type="qwen3_moe",
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_layers=3,
            num_heads=2,
            num_kv_heads=1,
            head_dim=32,
            rope_theta=1e4,
            rope_scaling=None,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            qk_norm=True,
            attention_bias=False,
            max_position_embeddings=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            mlp_only_layers=(1,),
            param_dtype="float32",
        )
        model = init_model(cfg, None, seed=5)
    else:
        model, cfg = load_model(
            build_tiny_model(tmp_path / "m", tied=variant == "tied", seed=3), param_dtype="float32"
        )
    for dtype, max_chunk_bytes in (("float32", 1 << 30), ("bfloat16", 1 << 30), ("bfloat16", 1)):
        expected = list(state_to_hf_tensors(model, cfg, dtype))
        metas, tensors = hf_device_tensors(model, cfg, dtype, max_chunk_bytes=max_chunk_bytes)
        got = _unstacked(tensors, metas)
        assert [m.name for m in metas] == [n for n, _ in expected]
        assert [m.shape for m in metas] == [a.shape for _, a in expected]
        for (name, a), t in zip(expected, got, strict=True):
            assert t.is_contiguous(), name
            assert torch.equal(t, to_torch(a)), name


_SHARDED_SCRIPT = r"""
import sys, torch
import jax
from primejax.models.hf_io import load_model, state_to_hf_tensors
from primejax.models.sharding import make_mesh
from primejax.models.tiny import build_tiny_model
from primejax.transports.weights.collective.device import hf_device_tensors
from primejax.transports.weights.collective.sender import to_torch

assert jax.device_count() == 2
path = build_tiny_model(sys.argv[1], tied=False, seed=4)
for fsdp, tensor in ((2, 1), (1, 2)):
    mesh = make_mesh(1, fsdp, 1, tensor, devices=jax.devices())
    model, cfg = load_model(path, param_dtype="float32", mesh=mesh)
    assert any(len(v.sharding.device_set) == 2 for v in jax.tree.leaves(model) if hasattr(v, "sharding"))
    expected = list(state_to_hf_tensors(model, cfg, "bfloat16"))
    metas, tensors = hf_device_tensors(model, cfg, "bfloat16", device=jax.devices()[1], max_chunk_bytes=1)
    got = []
    for t in tensors:  # a run of layers comes stacked, one item
        got += [t] if tuple(t.shape) == metas[len(got)].shape else list(t.unbind(0))
    assert [m.name for m in metas] == [n for n, _ in expected]
    for (name, a), t in zip(expected, got, strict=True):
        assert torch.equal(t, to_torch(a)), name
print("ok")
"""


def test_device_tensors_of_weights_sharded_over_several_local_devices(tmp_path):
    """A one-process trainer on a mesh of 2 devices (FSDP, or tensor parallel): each parameter is gathered onto
    the sending device on device and equals the export's tensor. (On 2 GPUs this failed: a jitted call may not
    put its output on one device of its inputs' two.)"""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
    }
    out = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT, str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_a_sender_failing_mid_round_completes_it_and_the_receiver_rejects_it_at_once(tmp_path):
    """The sender's tensors fail after the first bucket (a conversion error): it still completes every broadcast
    (zero buckets) and marks the round aborted, so the receiver, already inside the collective, finishes it and
    refuses it at once, long before the transfer timeout (an NCCL receiver left waiting is torn down with its
    process: the inference server). The sender reports failure (the filesystem fallback)."""
    timeout_s = 60.0
    sender = CollectiveSender(tmp_path, secret=SECRET, timeout_s=timeout_s, bucket_bytes=64)
    named = _named()
    metas = tensor_metas(named)

    def failing():
        yield named[0][1]
        raise RuntimeError("conversion failed")

    receiver, outcome = wire.Receiver(), {}

    def serve():
        deadline = time.monotonic() + 10
        while (offer := latest_offer(tmp_path)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        try:
            receiver.receive(offer.init_info, offer.update_info, 1, "cpu", lambda pairs: None, SECRET)
        except ValueError as e:
            outcome["error"] = str(e)
        outcome["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=serve)
    t.start()
    assert sender.send_lazy(1, metas, failing()) is False
    t.join(30)
    assert "aborted" in outcome.get("error", "") and "conversion failed" in outcome["error"], outcome
    assert outcome["seconds"] < timeout_s / 4, outcome


def test_nccl_groups_are_built_to_raise_not_to_end_the_process():
    """torch reads these in ProcessGroupNCCL's constructor: blocking wait (a dead peer raises at the timeout in the
    waiting thread) and error handling 2 (abort the communicators, keep the process: a vLLM worker is the server).
    They are set only while primejax's group is built and the previous values come back."""
    import os

    assert wire.NCCL_GROUP_ENV == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    before = {k: os.environ.get(k) for k in wire.NCCL_GROUP_ENV}
    with wire._nccl_errors_raise():
        assert all(os.environ[k] == v for k, v in wire.NCCL_GROUP_ENV.items())
    assert {k: os.environ.get(k) for k in wire.NCCL_GROUP_ENV} == before
