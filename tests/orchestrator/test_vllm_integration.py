"""End to end on CPU with the real vLLM server: three reverse-text steps, a fake trainer broadcasting
perturbed weights, the orchestrator loading them into the server and tagging samples with their version.

The same run logs to every sink (TensorBoard, JSONL, W&B offline) with the servers' metrics, the timeline and
sample rollouts on (the `monitor` section): the second test reads them back."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from orch_fakes import make_orchestrator, small_config
from wandb_files import wandb_history

from primejax.config import typed
from primejax.contracts.batch import read_batch, step_dir
from primejax.inference.client import InferenceClient
from primejax.rendering.renderer import load_tokenizer
from primejax.transports.weights.filesystem.broadcast import write_broadcast
from primejax.utils.monitor import Monitor, read_jsonl

pytestmark = pytest.mark.vllm
STEPS = 3


class RecordingClient(InferenceClient):
    """The real client, remembering every completion the server returned."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.completions = []

    async def generate(self, prompt_token_ids, **kw):
        out = await super().generate(prompt_token_ids, **kw)
        self.completions += out
        return out


def write_perturbed(model_dir: Path, out: Path, seed: int) -> None:
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(seed)
    for f in model_dir.glob("*.safetensors"):
        tensors = {
            k: (v + 0.02 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in load_file(f).items()
        }
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    for name in ("config.json", "model.safetensors.index.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)


async def fake_trainer(run_dir: Path, model_dir: Path) -> None:
    for n in range(1, STEPS + 1):
        while not step_dir(run_dir, n).exists():
            await asyncio.sleep(0.05)
        write_broadcast(run_dir, n, lambda d, n=n: write_perturbed(model_dir, d, seed=n))


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory, vllm_server, tiny_model_dir):
    tmp_path = tmp_path_factory.mktemp("vllm_integration")
    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, batch_size=8, group_size=4, async_level=1)
    cfg.model.path = str(tiny_model_dir)
    cfg.orchestrator.update({"seq_len": 512, "max_prompt_tokens": 256})
    cfg.orchestrator.sampling.max_tokens = 24  # unseeded: seeds need async_level 0 (config rule)
    cfg.orchestrator.filters.post_batch = ()  # a random tiny model's rewards may tie; ship everything
    # The barrier: each step's tokens are generated inside that step, which the server-metrics test asserts (a
    # continuous pool may cut a step from groups that finished in the previous one: 0 tokens/s in its window).
    cfg.orchestrator.pool.mode = "step"
    cfg.monitor.wandb = importlib.util.find_spec("wandb") is not None  # in the test extra
    cfg.monitor.server_poll_s = 0.5
    cfg.monitor.timeline_image_every = STEPS
    tokenizer = load_tokenizer(str(tiny_model_dir))

    async def main():
        client = RecordingClient(vllm_server.base_url, timeout_s=120, max_retries=2)
        probe = list(range(3, 40))
        try:
            before = await client.score(probe)
            c = typed(cfg)
            with Monitor.from_config(run_dir, "orchestrator", c.monitor, c.to_dict()) as monitor:
                orch = make_orchestrator(
                    cfg, client=client, tokenizer=tokenizer, run_dir=run_dir, monitor=monitor, watch=c.monitor
                )
                await orch.tracker.sync_with_server()
                history = (await asyncio.gather(orch.run(STEPS), fake_trainer(run_dir, tiny_model_dir)))[0]
            await orch.tracker.refresh()  # pick up the last broadcast too
            after = await client.score(probe)
            version = await client.weights_version()
            return client.completions, history, before, after, version
        finally:
            await client.reload_weights()  # the server is shared by the session: leave it as we found it
            await client.close()

    return (*asyncio.run(main()), run_dir, tokenizer)


def test_reverse_text_steps_against_vllm_with_weight_updates(watched_run):
    completions, history, before, after, version, run_dir, tokenizer = watched_run
    assert version == STEPS
    assert not np.allclose(np.array(before[1:]), np.array(after[1:]), atol=1e-4)  # the weights really changed
    served = {tuple(c.prompt_token_ids + c.completion_token_ids): c for c in completions}
    versions = []
    for n in range(1, STEPS + 1):
        batch = read_batch(step_dir(run_dir, n) / "rank_0.npz", vocab_size=len(tokenizer))
        assert batch.meta["num_samples"] == 8
        versions.append(batch.meta["min_policy_version"])
        for row in range(batch.rows):
            for seg in range(1, int(batch.segment_ids[row].max()) + 1):
                sel = batch.segment_ids[row] == seg
                tokens = tuple(batch.tokens[row, sel].tolist())
                c = served[tokens]  # token ids equal the server's, prompt and completion
                mask = batch.loss_mask[row, sel]
                assert mask.sum() == len(c.completion_token_ids) and not mask[: len(c.prompt_token_ids)].any()
                lps = batch.inference_logprobs[row, sel][mask]
                np.testing.assert_allclose(lps, np.float32(c.completion_logprobs), rtol=0, atol=0)
                assert np.isfinite(lps).all() and (lps <= 0).all() and (lps < 0).any()
    # k = 1: step 3 must sample θ_1 or newer; the tags never go backwards.
    assert versions[0] == 0 and versions[2] >= 1 and versions == sorted(versions)
    assert all(m["staleness/max"] <= 1 for m in history)


def test_the_run_logs_server_metrics_timeline_and_samples_to_every_sink(watched_run):
    history, run_dir = watched_run[1], watched_run[5]
    rows = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # the server generated every completion token the orchestrator received, within the step
        assert r["server/0/gen_tokens_per_s"] > 0 and r["server/0/prompt_tokens_per_s"] > 0, r
        assert r["server/total/gen_tokens_per_s"] == r["server/0/gen_tokens_per_s"]
        assert 0 <= r["server/0/kv_cache_usage"] <= r["server/0/kv_cache_usage_max"] <= 1
        assert r["server/0/running"] >= 0 and r["server/0/waiting"] >= 0 and r["server/0/preemptions"] >= 0
    loads = [r["server/0/weight_update_s"] for r in rows if "server/0/weight_update_s" in r]
    assert loads and all(s > 0 for s in loads)  # the fake trainer's broadcasts were loaded during the run
    # The timeline: each step's groups' requests and env calls, and the weight updates, in Chrome trace form.
    names, cats = set(), set()
    for step in range(1, STEPS + 1):
        trace = json.loads((run_dir / "timeline" / f"step_{step}.json").read_text())
        threads = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert all((e["pid"], e["tid"]) in threads and e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
        assert sum(e["name"] == "request" for e in spans) >= history[step - 1]["rollouts/total"] // 4
        names |= {e["name"] for e in spans}
        cats |= {e["cat"] for e in spans}
    assert {"request", "score", "generate", "postprocess"} <= names and {"weights", "env", "phase"} <= cats
    samples = read_jsonl(run_dir / "tables" / "orchestrator" / "rollout_samples.jsonl")
    assert [r["step"] for r in samples] == [1, 1, 2, 2, 3, 3]  # samples_per_env 2, one env
    assert all(r["completion"].startswith("assistant: ") and 0 <= r["reward"] <= 1 for r in samples)
    if importlib.util.find_spec("wandb") is None:
        return
    wb = wandb_history(run_dir, "orchestrator")
    for r in rows:
        logged = wb[r["step"]]
        assert float(logged["server/0/gen_tokens_per_s"]) == pytest.approx(r["server/0/gen_tokens_per_s"])
        assert float(logged["reward/mean"]) == pytest.approx(r["reward/mean"])
        assert json.loads(logged["rollout_samples/_type"]) == "table-file"
    assert json.loads(wb[STEPS]["timeline/_type"]) == "image-file"  # the last step's timeline, drawn
    assert not any("timeline/_type" in wb[s] for s in range(1, STEPS))


def browser() -> str | None:
    return next(
        (p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None
    )


@pytest.mark.skipif(
    browser() is None or importlib.util.find_spec("tensorboard") is None,
    reason="needs a Chromium and the tensorboard package (CI installs neither browser)",
)
def test_tensorboard_in_a_headless_browser_shows_the_server_metrics(watched_run, tmp_path):
    """TensorBoard serves the run's event files; the page a real browser renders lists the servers' metrics
    (its time-series dashboard names each card's tag in the DOM), and a screenshot of it is taken."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.parse
    import urllib.request

    run_dir = watched_run[5]
    with socket.socket() as s:  # a free port on the loopback interface
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(run_dir / "tensorboard"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        names = (
            "server/0/gen_tokens_per_s",
            "server/0/prompt_tokens_per_s",
            "server/0/kv_cache_usage",
            "server/0/running",
            "server/0/waiting",
            "server/0/preemptions",
            "server/0/weight_update_s",
            "server/total/gen_tokens_per_s",
        )
        deadline = time.monotonic() + 180
        while (
            True
        ):  # ready when it serves the run's tags (it loads the event files after it starts answering)
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5
                ) as r:
                    if set(names) <= set(json.loads(r.read()).get("orchestrator", {})):
                        break
            except (OSError, ValueError):
                pass
            assert server.poll() is None and time.monotonic() < deadline, "tensorboard did not serve the tags"
            time.sleep(0.5)
        # The time-series dashboard draws the cards of its tag filter (one page of them): exactly these.
        url = f"http://127.0.0.1:{port}/?tagFilter={urllib.parse.quote('^(' + '|'.join(names) + ')$')}#timeseries"
        common = [
            browser(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--virtual-time-budget=30000",
            "--window-size=1400,3000",
        ]
        for _ in range(3):  # a loaded box may hand over the page before its cards are drawn: look again
            dom = subprocess.run(
                [*common, "--dump-dom", url], capture_output=True, text=True, timeout=300
            ).stdout
            shown = set(re.findall(r'title="(server/[^"]+)"', dom))
            if shown:
                break
        assert shown == set(names), sorted(shown)
        shot = tmp_path / "tensorboard_servers.png"
        subprocess.run([*common, f"--screenshot={shot}", url], capture_output=True, timeout=300)
        assert shot.stat().st_size > 20_000  # a rendered page, not an empty one
    finally:
        server.terminate()
        server.wait(timeout=30)
