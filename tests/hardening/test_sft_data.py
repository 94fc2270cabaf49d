"""Bad SFT data ends in one line naming `file:line` and exit status 2, never a traceback, never "SFT model
written" with status 0 (the launcher would then start RL from an untrained model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import primejax.sft.loop as sft
from primejax.config import default_config, typed
from primejax.sft.data import SFTDataError

REPO = Path(__file__).resolve().parents[2]
GOOD = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
)

CASES = {
    "bad_json": ('{"messages": [', "not valid JSON"),
    "list_line": ('[{"role": "user", "content": "hi"}]', "must be a JSON object"),
    "no_assistant": (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant message"),
    "int_content": (
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 7}]}),
        "'content' must be a string",
    ),
    "non_utf8": (b'{"prompt": "\xff\xfe", "completion": "x"}', "not UTF-8"),
    "too_long": (json.dumps({"prompt": "word " * 400, "completion": "ok"}), "more than sft.seq_len"),
    # issue 48: a RecursionError traceback
    "deep": ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deeply"),
}


def _load(c, tokenizer):
    cfg = typed(c)
    return sft.load_samples(cfg.sft, cfg.orchestrator.envs, tokenizer)


def _cfg(model_dir: Path, data: Path, tmp_path: Path):
    c = default_config()
    c.model.path, c.sft.data_path, c.sft.steps, c.sft.seq_len = str(model_dir), str(data), 2, 128
    c.run.output_dir, c.run.name = str(tmp_path / "runs"), "sft"
    return c


def _write(tmp_path: Path, line: str | bytes) -> Path:
    path = tmp_path / "data.jsonl"
    body = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(GOOD.encode() + b"\n" + body + b"\n")  # the bad line is line 2
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_line_names_file_and_line(tiny_model_dir, tokenizer, tmp_path, case):
    line, expected = CASES[case]
    data = _write(tmp_path, line)
    with pytest.raises(SFTDataError) as err:
        _load(_cfg(tiny_model_dir, data, tmp_path), tokenizer)
    assert str(err.value).startswith(f"{data}:2: ") and expected in str(err.value), err.value


def test_empty_file_is_an_error(tiny_model_dir, tokenizer, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n")
    with pytest.raises(SFTDataError, match="no SFT examples"):
        _load(_cfg(tiny_model_dir, data, tmp_path), tokenizer)


def test_cli_prints_one_line_and_exits_2(tiny_model_dir, tmp_path):
    data = _write(tmp_path, CASES["too_long"][0])  # found while tokenizing, after the model dir is read
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "primejax.sft",
            "--config",
            str(REPO / "configs" / "debug.py"),
            f"--config.model.path={tiny_model_dir}",
            f"--config.sft.data_path={data}",
            "--config.sft.steps=2",
            "--config.sft.seq_len=128",
            f"--config.run.output_dir={tmp_path / 'runs'}",
        ],
        cwd=tmp_path,  # the code under test comes from the install or PYTHONPATH, not the cwd
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [
        ln for ln in out.stderr.splitlines() if ln.strip() and " INFO " not in ln and " WARNING " not in ln
    ]
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: sft.data_path: {data}:2: "), out.stderr[-2000:]
    assert "SFT model written" not in out.stderr + out.stdout
