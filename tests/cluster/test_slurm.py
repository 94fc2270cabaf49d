"""The SLURM job script and its driver's pure parts, without a SLURM (the job itself: test_slurm_job.py).

The task environment tests set SLURM's variables by hand, as srun sets them for each task."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from primejax.cluster.slurm import render_script, script_path, write_script
from primejax.cluster.slurm_job import (
    JobError,
    Roles,
    hostnames,
    job_config,
    split_nodes,
    task_command,
    task_env,
)
from primejax.config import default_config, typed
from primejax.contracts.cluster import SlurmConfig
from primejax.utils.sections import ConfigError


def _cfg(tmp_path: Path, **slurm):
    c = default_config()
    c.model.path = str(tmp_path / "model")
    c.run.output_dir, c.run.name = str(tmp_path / "runs"), "r"
    for key, value in slurm.items():
        c.slurm[key] = value
    return typed(c)


def test_script_asks_every_node_and_execs_the_driver(tmp_path):
    cfg = _cfg(
        tmp_path,
        trainer_nodes=2,
        inference_nodes=3,
        gpus_per_node=8,
        partition="gpu",
        time="2-00:00:00",
        extra_args=("--constraint=h100",),
        setup=("module load cuda",),
    )
    path = write_script(cfg)
    assert path == script_path(cfg.run_dir.resolve()) and path.parent.name == "cluster"
    text = path.read_text()
    lines = text.splitlines()
    for wanted in (
        "#SBATCH --nodes=5",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --requeue",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --constraint=h100",
        "#SBATCH --exclusive",
        "module load cuda",
    ):
        assert wanted in lines, wanted
    assert lines[-1].startswith("exec ") and "-m primejax.cluster.slurm_job --config" in lines[-1]
    assert str(cfg.run_dir.resolve() / "configs" / "train.json") in lines[-1]
    assert (cfg.run_dir / "configs" / "train.json").exists()  # the config the driver reads
    assert (
        "TOKEN" not in text.upper()
    )  # the admin secret is made inside the job, never written into the script
    assert all(line.startswith("#SBATCH") for line in lines[1 : lines.index("set -euo pipefail") - 1])


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("partition", "gpu; rm -rf /", "one word"),
        ("time", "two days", "minutes or"),
        ("extra_args", ("-N 3",), "--option"),
        ("extra_args", ("--x\n#SBATCH --y",), "--option"),
        ("setup", ("a\nb",), "one shell line"),
        ("coordinator_port", 8000, "inference_port"),
    ],
)
def test_bad_options_are_refused_by_name(key, value, match):
    with pytest.raises(ConfigError, match=match) as err:
        SlurmConfig(**{key: value})
    assert str(err.value).startswith(key)


def test_one_trainer_process_per_gpu_node():
    with pytest.raises(ConfigError, match="one JAX process owns a node's GPUs"):
        SlurmConfig(gpus_per_node=8, trainer_tasks_per_node=2)


def test_nodes_split_in_order_or_shared():
    hosts = ["n1", "n2", "n3", "n4"]
    assert split_nodes(hosts, SlurmConfig(trainer_nodes=2, inference_nodes=2)) == Roles(
        ("n1", "n2"), ("n3", "n4")
    )
    assert split_nodes(hosts[:1], SlurmConfig(trainer_nodes=1, inference_nodes=0)) == Roles(("n1",), ("n1",))
    with pytest.raises(JobError, match="the job has 2 node"):
        split_nodes(hosts[:2], SlurmConfig(trainer_nodes=2, inference_nodes=1))


def test_job_config_takes_its_addresses_from_the_node_list(tmp_path):
    cfg = _cfg(
        tmp_path,
        trainer_nodes=2,
        trainer_tasks_per_node=1,
        inference_nodes=2,
        coordinator_port=1234,
        inference_port=8100,
    )
    job = job_config(cfg, Roles(("t0", "t1"), ("i0", "i1")))
    assert job.trainer.distributed.num_processes == 2
    assert job.trainer.distributed.coordinator_address == "t0:1234"
    assert job.orchestrator.client.base_urls == ("http://i0:8100", "http://i1:8100")
    assert (job.inference.host, job.inference.port) == ("0.0.0.0", 8100)  # reachable from the other nodes
    shared = job_config(_cfg(tmp_path, trainer_tasks_per_node=2, inference_nodes=0), Roles(("t0",), ("t0",)))
    assert shared.inference.host == "127.0.0.1" and shared.trainer.distributed.num_processes == 2
    assert shared.orchestrator.client.base_urls == ("http://127.0.0.1:8000",)  # beside it: not by host name


def test_trainer_rank_comes_from_slurms_task_variables(tmp_path):
    job = job_config(_cfg(tmp_path, trainer_nodes=2, inference_nodes=1), Roles(("t0", "t1"), ("i0",)))
    env = task_env("trainer", job, {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    assert env["PRIMEJAX_PROCESS_ID"] == "1" and env["PRIMEJAX_NUM_PROCESSES"] == "2"
    assert env["PRIMEJAX_COORDINATOR_ADDRESS"] == job.trainer.distributed.coordinator_address
    for bad in (
        {},
        {"SLURM_PROCID": "x", "SLURM_NTASKS": "2"},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "3"},
        {"SLURM_PROCID": "2", "SLURM_NTASKS": "2"},
    ):
        with pytest.raises(JobError):
            task_env("trainer", job, bad)
    gpu = job_config(_cfg(tmp_path, gpus_per_node=8), Roles(("t0",), ("i0",)))
    assert task_env("orchestrator", gpu, {})["CUDA_VISIBLE_DEVICES"] == ""  # no GPU for the orchestrator


def test_servers_per_node_get_their_own_port_and_gpus(tmp_path):
    """inference.replicas servers per inference node: consecutive ports, the node's GPUs split between them."""
    c = default_config()
    c.model.path, c.run.output_dir = str(tmp_path / "model"), str(tmp_path / "runs")
    c.inference.replicas, c.inference.tensor_parallel_size = 4, 2
    c.slurm.gpus_per_node, c.slurm.inference_nodes, c.slurm.inference_port = 8, 2, 8000
    job = job_config(typed(c), Roles(("t0",), ("i0", "i1")))
    assert "#SBATCH --ntasks-per-node=4" in render_script(typed(c), tmp_path / "train.json").splitlines()
    assert job.orchestrator.client.base_urls == tuple(
        f"http://{h}:{8000 + i}" for h in ("i0", "i1") for i in range(4)
    )
    config = tmp_path / "inference.json"
    env, argv = task_command("inference", job, config, {"SLURM_LOCALID": "2"})
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and argv[-1] == "--config.inference.port=8002"
    assert argv[1:5] == ["-m", "primejax.inference", "--config", str(config)]
    with pytest.raises(JobError, match="SLURM_LOCALID='4'"):
        task_command("inference", job, config, {"SLURM_LOCALID": "4"})


@pytest.mark.skipif(
    shutil.which("scontrol") is None, reason="needs SLURM's scontrol (apt-get install slurm-client)"
)
def test_node_list_expanded_by_scontrol():
    assert hostnames("gpu[01-03],cpu7") == ["gpu01", "gpu02", "gpu03", "cpu7"]
    with pytest.raises(JobError, match="inside a SLURM job"):
        hostnames("")


def test_the_train_command_writes_the_script_and_the_manifests(tmp_path):
    """`python -m primejax.train --launcher {slurm,k8s}`: the dispatch the user types (no job submitted)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    base = [
        sys.executable,
        "-m",
        "primejax.train",
        "--config",
        str(repo / "configs" / "demo.py"),
        f"--config.run.output_dir={tmp_path}",
        "--config.run.name=mn",
        f"--config.model.path={tmp_path}/m",
    ]
    slurm = subprocess.run(
        [*base, "--launcher", "slurm"], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert slurm.returncode == 0, slurm.stderr
    assert "#SBATCH --nodes=2" in script_path(tmp_path / "mn").read_text() and "sbatch " in slurm.stdout
    k8s = subprocess.run(
        [*base, "--launcher", "k8s", "--config.k8s.image=r/p:1"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert k8s.returncode == 0, k8s.stderr
    assert "kubectl apply" in k8s.stdout
