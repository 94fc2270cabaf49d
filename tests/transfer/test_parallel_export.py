"""The parallel export (primejax/transports/weights/filesystem/export.py) writes exactly the gather export's files with either writer
(mmap, pwrite), on a 4-device CPU mesh where the HF tensors' rows are split over the devices (Qwen3-MoE with a dense
layer, bf16); a full disk is one OSError before the mapping is touched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import sys, tempfile
    from pathlib import Path
    import jax, numpy as np
    from safetensors.numpy import load_file
    from primejax.models.config import ModelConfig
    from primejax.models.hf_io import export_safetensors
    from primejax.models.sharding import make_mesh
    from primejax.models.transformer import init_model
    from primejax.transports.weights.filesystem.export import export_parallel
    from primejax.transports.weights.shards import RowShards

    assert jax.device_count() == 4
    tmp = Path(tempfile.mkdtemp())
    mesh = make_mesh(fsdp=2, tensor=2)
    mcfg = ModelConfig(model_type="qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3,
                       num_heads=2, num_kv_heads=1, head_dim=32, rope_theta=1e4, rope_scaling=None,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True, attention_bias=False,
                       max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       mlp_only_layers=(1,), param_dtype="float32")
    moe = init_model(mcfg, mesh, seed=5)

    def files(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out[f.name] = load_file(str(f))
        return out

    for name, model, cfg in (("moe", moe, mcfg),):
        for dtype in ("bfloat16",):
            split = [p for p in RowShards(model, cfg, dtype).pieces() if p.start > 0]
            assert split, "no tensor was split into row blocks"
            a = tmp / f"{name}-{dtype}-gather"
            export_safetensors(model, cfg, a, dtype=dtype, max_shard_bytes=40_000)
            for writer in ("mmap", "pwrite"):
                b = tmp / f"{name}-{dtype}-parallel-{writer}"
                b.mkdir()
                info = export_parallel(model, cfg, b, dtype=dtype, max_shard_bytes=40_000, threads=3, writer=writer)
                fa, fb = files(a), files(b)
                assert list(fa) == list(fb) and len(fa) > 1, (list(fa), list(fb))
                for f in fa:
                    assert sorted(fa[f]) == sorted(fb[f]), f
                    for k, x in fa[f].items():
                        y = fb[f][k]
                        assert x.dtype == y.dtype and x.shape == y.shape, k
                        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), (name, dtype, k)
                assert (a / "model.safetensors.index.json").read_text() == (b / "model.safetensors.index.json").read_text()
                assert (a / "config.json").read_text() == (b / "config.json").read_text()
                assert info["bytes"] == info["bytes_written"] == sum(x.nbytes for t in fa.values() for x in t.values())

    # a full disk: the blocks' reservation fails before any mapping exists; the error is the OSError itself
    import errno, os
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    os.posix_fallocate = full
    c = tmp / "full"
    c.mkdir()
    try:
        export_parallel(moe, mcfg, c, dtype="bfloat16", max_shard_bytes=40_000, writer="mmap")
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    else:
        raise AssertionError("a full disk was not reported")
    print("ok")
    """
)


def test_parallel_export_writes_the_gather_exports_files():
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")
