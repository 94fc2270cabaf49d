"""AdamW's moments are sharded like their parameters (FSDP), not replicated on every device.

`jax.jit(optimizer.init)` alone replicates them (zeros_like does not propagate a sharding): 8 bytes per
parameter on every device. Found by the TPU ahead-of-time compile (docs/tpu.md), where it made a Qwen3-8B
step need 65 GB of optimizer state per chip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, jax
from primejax.models.config import ModelConfig
from primejax.models.sharding import make_mesh
from primejax.models.transformer import init_model
from primejax.trainer import optim
from primejax.trainer.step import init_state
cfg = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4, rope_scaling=None, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, qk_norm=True, attention_bias=False, max_position_embeddings=128)
mesh = make_mesh(fsdp=2, tensor=2)
opt = optim.make_optimizer(dict(max_norm=1.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01), optim.make_schedule(1e-3))
state = init_state(init_model(cfg, mesh), opt, mesh=mesh)
spec = lambda x: str(x.sharding.spec)
adam = state.opt_state[1][0]
out = {"params": jax.tree.map(spec, state.params), "mu": jax.tree.map(spec, adam.mu),
       "nu": jax.tree.map(spec, adam.nu), "count": spec(adam.count)}
print(json.dumps(out))
"""


def test_adam_moments_take_their_parameters_shardings():
    env = dict(
        os.environ,
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mu"] == out["params"] and out["nu"] == out["params"], (out["mu"], out["params"])
    assert "fsdp" in out["params"]["lm_head"] and "tensor" in out["params"]["lm_head"]  # really sharded
    assert out["count"] == "P()"
