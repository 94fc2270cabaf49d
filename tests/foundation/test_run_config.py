"""Config validation: every rule has a failing case, and the CLI turns bad input into one line + exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from primejax.config import ConfigError, default_config, from_json, lock, to_json, validate
from primejax.config.cli import UsageError, parse_config

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _cfg(**changes):
    c = default_config()
    c.model.path = "some/model"
    lock(c)
    for key, value in changes.items():
        node = c
        *parents, leaf = key.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def test_defaults_validate():
    assert validate(_cfg()) is not None


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"orchestrator__group_size": 5}, "orchestrator.batch_size"),
        ({"orchestrator__async_level": -1}, "orchestrator.async_level"),
        ({"orchestrator__seq_len": 100}, "orchestrator.seq_len"),
        ({"inference__max_model_len": 100}, "inference.max_model_len"),
        ({"orchestrator__batch_size": 0}, "orchestrator.batch_size"),
        ({"orchestrator__sampling__top_p": 0.0}, "orchestrator.sampling.top_p"),
        ({"orchestrator__sampling__temperature": -1.0}, "orchestrator.sampling.temperature"),
        ({"trainer__optim__lr": -1.0}, "trainer.optim.lr"),
        ({"trainer__scheduler__type": "exp"}, "trainer.scheduler.type"),
        (
            {"trainer__scheduler__type": "cosine", "trainer__scheduler__warmup_steps": 50},
            "trainer.scheduler.warmup_steps",
        ),
        ({"trainer__loss__type": "custom"}, "trainer.loss.import_path"),
        ({"trainer__loss__is_clip": 0.0}, "trainer.loss.is_clip"),
        ({"trainer__mesh__fsdp": 0}, "trainer.mesh.fsdp"),
        ({"trainer__mesh__data": -1}, "trainer.mesh"),
        ({"trainer__on_nonfinite": "ignore"}, "trainer.on_nonfinite"),
        ({"trainer__lm_head_saved_logits_gib": -0.5}, "trainer.lm_head_saved_logits_gib"),
        ({"model__param_dtype": "float16"}, "model.param_dtype"),
        ({"model__attention_impl": "flash"}, "model.attention_impl"),
        ({"model__expert_parallel": "alltoall"}, "model.expert_parallel"),
        ({"model__gmm_impl": "cuda"}, "model.gmm_impl"),
        ({"model__deltanet_impl": "triton"}, "model.deltanet_impl"),
        ({"model__a2a_capacity_factor": float("inf")}, "model.a2a_capacity_factor"),
        ({"model__a2a_capacity_factor": 0.5}, "model.a2a_capacity_factor"),
        (
            {"model__keep_gathered_experts": True, "model__expert_parallel": "a2a"},
            "model.keep_gathered_experts",
        ),
        ({"model__keep_exchanged_tokens": True}, "model.keep_exchanged_tokens"),
        ({"model__path": ""}, "model.path"),
        ({"run__resume_step": "yesterday"}, "run.resume_step"),
        ({"run__name": "a/b"}, "run.name"),
        ({"run__max_steps": 0}, "run.max_steps"),
        ({"orchestrator__filters__pre_batch": ("gibberish", "nonsense")}, "orchestrator.filters.pre_batch"),
        ({"orchestrator__filters__repetition_threshold": 1.5}, "orchestrator.filters.repetition_threshold"),
        (
            {"orchestrator__buffer__easy_fraction": 0.7, "orchestrator__buffer__hard_fraction": 0.7},
            "orchestrator.buffer.easy_fraction",
        ),
        ({"orchestrator__buffer__oversampling_factor": 0.5}, "orchestrator.buffer.oversampling_factor"),
        ({"orchestrator__algo__sampling__source": "teacher"}, "orchestrator.algo.sampling.source"),
        ({"orchestrator__algo__length_penalty__type": "words"}, "orchestrator.algo.length_penalty.type"),
        ({"sft__steps": 10}, "sft.data_path"),
        ({"orchestrator__sampling__seed": 7}, "orchestrator.sampling.seed"),
        ({"sft__steps": 10, "sft__from_env": "nope"}, "sft.from_env"),
        (
            {"model__build_tiny__tokenizer": "bytes", "model__build_tiny__vocab_size": 100},
            "model.build_tiny.vocab_size",
        ),
        ({"model__build_tiny__num_kv_heads": 3}, "model.build_tiny.num_kv_heads"),
        ({"orchestrator__algo__roles": {"tool": -1.0}}, "orchestrator.algo.roles"),
        ({"inference__gpu_memory_utilization": 1.5}, "inference.gpu_memory_utilization"),
    ],
)
def test_each_rule_rejects_with_the_key_named(changes, key):
    with pytest.raises(ConfigError) as err:
        validate(_cfg(**changes))
    assert err.value.key == key, str(err.value)


def test_model_section_choices_reach_the_model_config():
    from primejax.config import typed
    from primejax.trainer.loop import model_config

    cfg = typed(
        _cfg(
            model__path="",
            trainer__fake_data__enabled=True,
            model__build_tiny__family="qwen3_moe",
            model__scan_layers=True,
            model__expert_parallel="ep",
            model__gmm_impl="xla",
            model__remat_policy="full",
        )
    )
    m = model_config(cfg.model)
    assert (m.model_type, m.scan_layers, m.expert_parallel, m.gmm_impl, m.remat_policy) == (
        "qwen3_moe",
        True,
        "ep",
        "xla",
        "full",
    )


def test_env_rules():
    c = _cfg()
    c.orchestrator.envs.reverse_text.weight = 0.0
    with pytest.raises(ConfigError, match="orchestrator.envs.reverse_text.weight"):
        validate(c)
    c = _cfg()
    c.orchestrator.envs.reverse_text.id = ""
    with pytest.raises(ConfigError, match="orchestrator.envs.reverse_text.id"):
        validate(c)


def test_locked_tree_rejects_unknown_keys_and_wrong_types():
    c = _cfg()
    with pytest.raises(AttributeError):
        c.trainer.optim.lrr = 1.0
    with pytest.raises(TypeError):
        c.orchestrator.group_size = "abc"


def test_json_round_trip_keeps_every_value():
    c = _cfg(trainer__optim__lr=3e-4, orchestrator__filters__post_batch=("zero_advantage",))
    c.orchestrator.envs.reverse_text.args = {"min_len": 2, "system_prompt": ""}
    with c.unlocked():
        c.orchestrator.envs["extra"] = default_config().orchestrator.envs.reverse_text
    c.orchestrator.envs.extra.id = "arithmetic"
    c2 = from_json(to_json(c))
    assert json.loads(to_json(c2)) == json.loads(to_json(c))
    assert (
        c2.orchestrator.envs.reverse_text.args.min_len == 2 and c2.orchestrator.envs.extra.id == "arithmetic"
    )
    with pytest.raises(ConfigError, match=r"\.lrr: unknown key"):
        from_json(to_json(c).replace('"lr":', '"lrr":'))
    assert c2.orchestrator.filters.post_batch == ("zero_advantage",)


def test_parse_config_applies_overrides(tmp_path):
    cfg, fv = parse_config(
        [
            "--config",
            str(ROOT / "configs/debug.py"),
            "--config.trainer.optim.lr=1e-5",
            "--config.run.name=exp1",
        ],
        prog="t",
    )
    assert cfg.trainer.optim.lr == 1e-5 and cfg.run.name == "exp1"


@pytest.mark.parametrize(
    "arg, fragment",
    [
        ("--config.trainer.optim.lrr=1", "trainer.optim.lrr"),
        ("--config.orchestrator.group_size=abc", "orchestrator.group_size"),
        ("--config.orchestrator.group_size=5", "orchestrator.batch_size"),
    ],
)
def test_parse_config_errors_name_the_key(arg, fragment):
    with pytest.raises(UsageError, match=fragment.replace(".", r"\.")):
        parse_config(["--config", str(ROOT / "configs/debug.py"), arg], prog="t")


@pytest.mark.parametrize(
    "arg, fragment",
    [
        ("--config.trainer.optim.lrr=1", "trainer.optim.lrr"),
        ("--config.orchestrator.group_size=abc", "group_size"),
    ],
)
def test_cli_bad_input_is_one_line_and_nonzero(tmp_path, arg, fragment):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "primejax.train",
            "--config",
            "configs/debug.py",
            "--dry_run",
            arg,
            f"--config.run.output_dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_cli_dry_run_prints_and_records_resolved_config(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "primejax.train",
            "--config",
            "configs/debug.py",
            "--dry_run",
            f"--config.run.output_dir={tmp_path}",
            "--config.trainer.optim.lr=0.25",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["trainer"]["optim"]["lr"] == 0.25
    recorded = json.loads((tmp_path / "debug" / "configs" / "train.json").read_text())
    assert recorded == printed


def test_cli_dry_run_refuses_the_model_path_the_run_would_refuse(tmp_path):
    """Issue 48: `--dry_run` passed a model.path that does not exist (the tiny build off), which the run then
    refused; and a hub id (as the README's config example shows) got only 'is not a directory'."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "primejax.train",
            "--config",
            "configs/debug.py",
            "--dry_run",
            f"--config.run.output_dir={tmp_path}",
            "--config.model.build_tiny.enabled=False",
            "--config.model.path=Qwen/Qwen3-0.6B",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert errors == [
        "error: model.path: 'Qwen/Qwen3-0.6B' is not a directory; if it is a Hugging Face hub id, download it "
        "first (runs read a local directory only): `hf download Qwen/Qwen3-0.6B --local-dir models/Qwen3-0.6B` "
        "(or `huggingface-cli download ...`), then set model.path=models/Qwen3-0.6B"
    ], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_env_id_gets_one_message_with_a_suggestion_from_dry_run_and_run(tiny_model_dir):
    """Issue 48: a mistyped env id got two different messages (dry run: verifiers' EnvLoadError; run: the
    launcher's preflight) and no "did you mean". Both now print the preflight's line (`error: ` + it)."""
    from primejax.config import default_config, typed
    from primejax.launcher.envcheck import check_envs
    from primejax.launcher.preflight import PreflightError, check_env_ids

    c = default_config()
    c.model.path = str(tiny_model_dir)
    c.orchestrator.envs.reverse_text.id = "revers-text"
    cfg = typed(c)
    from primejax.envs.registry import registered_envs

    builtins = registered_envs()  # the shipped three, and any a test in this session registered before
    assert {"alphabet-sort", "arithmetic", "reverse-text"} <= set(builtins)
    expected = (
        f"orchestrator.envs.reverse_text.id: 'revers-text' is neither a builtin ({', '.join(builtins)}) nor "
        "an importable module ('revers_text' not found); did you mean 'reverse-text'?"
    )
    assert check_envs(cfg) == [(False, expected)]  # the dry run's line
    with pytest.raises(PreflightError) as err:  # the run's (launcher preflight)
        check_env_ids(cfg.orchestrator.envs)
    assert str(err.value) == expected


def test_configs_saved_before_the_typed_sections_still_load(tmp_path):
    """A resolved config written by primejax before this change (commit 5df0e45's `--dry_run`: JSON strings for
    kwargs and roles, an env naming its algorithm type plus its own custom advantage) loads; one that cannot be
    converted fails in one line naming the key."""
    saved = ROOT / "tests" / "foundation" / "data" / "config_before_typed_sections.json"
    cfg, _ = parse_config(["--config", str(saved)], prog="t")
    assert cfg.trainer.loss.kwargs == {"clip_eps": 0.3}
    assert cfg.orchestrator.algo.type == "echo" and cfg.orchestrator.algo.roles == {"tool": 0.5}
    env_algo = cfg.orchestrator.env_algo("reverse_text")
    assert env_algo.type == "max_rl" and env_algo.advantage.kwargs == {"value": 2.0}
    assert env_algo.advantage.import_path == "custom_advantage_fns.constant"
    old = json.loads(saved.read_text())
    old["trainer"]["loss"]["kwargs_json"] = "[1]"
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(old))
    with pytest.raises(UsageError, match=r"trainer\.loss\.kwargs_json: was renamed to 'kwargs'"):
        parse_config(["--config", str(path)], prog="t")
    old["trainer"]["loss"]["kwargs_json"] = "{}"
    old["trainer"]["gone"] = 1
    path.write_text(json.dumps(old))
    with pytest.raises(UsageError, match=r"trainer\.gone: unknown key"):
        parse_config(["--config", str(path)], prog="t")


def test_the_orchestrator_checkpoints_at_the_trainers_interval_unless_set():
    """A resume needs a step both processes saved: trainer.checkpoint.interval=2 alone once left the orchestrator at
    10, and a 2-step run had nothing to resume from (GPU tier, docs/testing.md)."""
    from primejax.config import typed

    c = default_config()
    c.model.path = "m"
    c.trainer.checkpoint.interval = 2
    assert typed(c).orchestrator.checkpoint.interval == 2
    c.orchestrator.checkpoint.interval = 4
    assert typed(c).orchestrator.checkpoint.interval == 4
    c.orchestrator.checkpoint.interval = 0
    assert typed(c).orchestrator.checkpoint.interval == 0
