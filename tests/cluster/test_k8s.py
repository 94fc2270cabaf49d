"""The Kubernetes manifests, validated against the published schemas: the built-in kinds against
kubernetes-validate's strict JSON schemas (generated from Kubernetes' own OpenAPI), the JobSet against its
CRD's schema (vendored in schemas/, see its $comment), both refusing unknown fields."""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from primejax.cluster import generate
from primejax.cluster.k8s import COMPLETION_INDEX, app_name, manifests, write_manifests
from primejax.cluster.k8s_task import TaskError, ready_mark, wait_ready
from primejax.config import default_config, from_json, typed
from primejax.contracts.cluster import K8sConfig
from primejax.envs.judge import JudgeServerConfig
from primejax.utils.sections import ConfigError, replace_key

K8S_VERSION = "1.33.0"  # JobSet v0.9 supports Kubernetes 1.31+
JOBSET_SCHEMA = json.loads((Path(__file__).parent / "schemas" / "jobset-v1alpha2.json").read_text())


def validate(doc: dict) -> None:
    """Raise on a manifest the API server's schema refuses (unknown fields included)."""
    if doc["kind"] != "JobSet":
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    defs = schema_contents(
        f"kubernetes-json-schema/v{K8S_VERSION}-local-strict/_definitions.json", K8S_VERSION
    )
    registry = Resource.from_contents(defs) @ Registry()
    jsonschema.Draft202012Validator(JOBSET_SCHEMA, registry=registry).validate(doc)


def _cfg(tmp_path: Path, **k8s):
    c = default_config()
    c.model.path = str(tmp_path / "model")
    c.run.output_dir, c.run.name = str(tmp_path / "runs"), "Qwen3_30B.moe"
    c.k8s.image = "registry.example/primejax:1"
    for key, value in k8s.items():
        c.k8s[key] = value
    return typed(c)


@pytest.fixture
def written(tmp_path):
    cfg = _cfg(
        tmp_path, trainer_pods=2, trainer_gpus=8, inference_replicas=2, inference_gpus=8, memory="1500Gi"
    )
    path, secret = write_manifests(cfg)
    return cfg, list(yaml.safe_load_all(path.read_text())), yaml.safe_load(secret.read_text()), secret


def test_every_manifest_validates_against_the_published_schemas(written):
    _, docs, secret, _ = written
    assert [d["kind"] for d in docs] == [
        "ConfigMap",
        "PersistentVolumeClaim",
        "Service",
        "StatefulSet",
        "JobSet",
    ]
    for doc in [*docs, secret]:
        validate(doc)


@pytest.mark.parametrize("kind", ["StatefulSet", "JobSet"])
def test_the_validation_refuses_what_the_api_server_refuses(written, kind):
    """So the test above can fail: an unknown field and a wrong type, in a built-in kind and in the JobSet."""
    _, docs, _, _ = written
    doc = next(d for d in docs if d["kind"] == kind)
    pod = (
        doc["spec"]["template"]["spec"]
        if kind == "StatefulSet"
        else doc["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]
    )
    bad = copy.deepcopy(doc)
    (
        pod_bad := (
            bad["spec"]["template"]["spec"]
            if kind == "StatefulSet"
            else bad["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]
        )
    )["containers"][0]["gpus"] = 8
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(bad)
    bad = copy.deepcopy(doc)
    if kind == "JobSet":
        bad["spec"]["failurePolicy"]["maxRestarts"] = "three"
    else:
        bad["spec"]["replicas"] = "two"
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(bad)
    assert pod["containers"][0]["command"][:3] == ["python", "-m", "primejax.cluster.k8s_task"] and pod_bad


def test_addresses_are_the_pods_dns_names(written):
    cfg, docs, _, _ = written
    app = app_name(cfg)
    assert app == "primejax-qwen3-30b-moe"
    inner = typed(from_json(docs[0]["data"]["train.json"]))
    # JobSet names pod i of the trainer job <jobset>-<replicated job>-<job index>-<i>, in subdomain <jobset>
    assert inner.trainer.distributed.coordinator_address == f"{app}-trainer-0-0.{app}.default.svc:29500"
    assert inner.trainer.distributed.num_processes == 2
    # a StatefulSet's pod i is <set>-<i>.<its headless service>
    assert inner.orchestrator.client.base_urls == tuple(
        f"http://{app}-inference-{i}.{app}-inference.default.svc:8000" for i in range(2)
    )
    assert inner.run.dir.as_posix() == "/primejax/runs/Qwen3_30B.moe"  # on the shared volume
    jobset = docs[-1]
    assert jobset["spec"]["network"]["subdomain"] == app
    trainer = jobset["spec"]["replicatedJobs"][1]
    assert trainer["template"]["spec"]["completionMode"] == "Indexed"
    env = {e["name"]: e for e in trainer["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (
        env["PRIMEJAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        == f"metadata.annotations['{COMPLETION_INDEX}']"
    )
    assert env["PRIMEJAX_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == f"{app}-admin"
    limits = trainer["template"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "8"


def test_the_secret_is_made_once_in_a_0600_file_and_nowhere_else(written):
    cfg, docs, secret, path = written
    token = secret["stringData"]["token"]
    assert len(token) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token not in yaml.safe_dump_all(docs)
    write_manifests(cfg)  # written again: the same secret (a live run's pods keep working)
    assert yaml.safe_load(path.read_text())["stringData"]["token"] == token


@pytest.mark.parametrize(
    ("key", "value"),
    [("namespace", "Bad_NS"), ("memory", "lots"), ("mount_path", "rel/dir"), ("coordinator_port", 8000)],
)
def test_bad_options_are_refused_by_name(key, value):
    with pytest.raises(ConfigError) as err:
        K8sConfig(**{key: value})
    assert str(err.value).startswith(key)


def test_an_image_is_required(tmp_path):
    with pytest.raises(ConfigError, match="k8s.image"):
        write_manifests(_cfg(tmp_path, image=""))


@pytest.mark.parametrize("scheduler", ["k8s", "slurm"])
def test_a_judge_server_is_refused_with_one_line_on_a_scheduler(tmp_path, capsys, scheduler):
    # only the single-node launcher starts the judge's server (primejax/envs/judge.py); nothing is written
    cfg = replace_key(_cfg(tmp_path), "judge", JudgeServerConfig(enabled=True, model_path="models/judge"))
    assert generate(cfg, scheduler) == 2
    assert capsys.readouterr().err == (
        f"error: judge.enabled: --launcher {scheduler} starts no judge server; give the envs' judges an address "
        "(their judge.base_url and model)\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_trainer_pod_waits_for_its_own_attempt(tmp_path):
    cfg = _cfg(tmp_path)
    env = {"PRIMEJAX_JOBSET_UID": "u1", "PRIMEJAX_RESTART_ATTEMPT": "2"}
    mark = ready_mark(cfg, env)
    assert mark != ready_mark(
        cfg, {**env, "PRIMEJAX_RESTART_ATTEMPT": "3"}
    )  # a restart never sees an old mark
    with pytest.raises(TaskError, match="PRIMEJAX_JOBSET_UID"):
        ready_mark(cfg, {})
    with pytest.raises(TaskError, match="did not prepare"):
        wait_ready(mark, timeout_s=0.01)
    mark.parent.mkdir(parents=True)
    mark.write_text("0")
    wait_ready(mark, timeout_s=0.01)
    assert len(manifests(cfg)) == 5
