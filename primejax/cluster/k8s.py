"""A run on Kubernetes: `python -m primejax.train --launcher k8s --config X` writes its manifests.

`<run>/cluster/k8s.yaml` (apply with `kubectl apply -f`), from the run's config:
- a ConfigMap with the resolved config, the addresses filled in from the cluster's DNS names;
- a JobSet (jobset.x-k8s.io/v1alpha2, https://jobset.sigs.k8s.io) of two replicated jobs: `driver` (one pod:
  settles what to resume from, writes the processes' configs, runs the orchestrator) and `trainer` (one
  Indexed Job of `k8s.trainer_pods` pods, one JAX process each; rank = the pod's completion index, the
  coordinator = pod 0's stable DNS name); any pod that fails restarts the whole JobSet (`failurePolicy`),
  which then resumes from the newest checkpoint pair, as a rerun of the local launcher does;
- a StatefulSet of `k8s.inference_replicas` vLLM servers behind a headless Service (stable names
  `<app>-inference-<i>.<app>-inference`), each `inference.tensor_parallel_size` GPUs;
- a PersistentVolumeClaim (ReadWriteMany) for the run directory, unless `k8s.volume_claim` names one.
`<run>/cluster/k8s-secret.yaml` (0600) holds the run's admin secret as a Secret, made once (kept when the
manifests are written again); every pod reads it from there into its environment, never from a command line.
Each pod runs `python -m primejax.cluster.k8s_task ROLE` (primejax/cluster/k8s_task.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from primejax.contracts.cluster import CONFIG_MOUNT, K8sConfig
from primejax.contracts.rundir import RunDir, write_resolved_config
from primejax.utils.sections import ConfigError, replace_keys

if TYPE_CHECKING:
    from primejax.config import Config

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
# JobSet's pod labels (kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go, pkg/constants/constants.go)
JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"
RESTART_LABEL = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # an Indexed Job's pod annotation


def app_name(cfg: Config) -> str:
    """`primejax-<run.name>` as a DNS label: the prefix of every object's name."""
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.run.name.lower()).strip("-")
    name = f"primejax-{name}"[:40].rstrip("-")  # room for '-inference-<i>' and JobSet's pod suffixes
    return name


def job_config(cfg: Config) -> Config:
    """The run's config inside the cluster: the volume's run directory, the pods' DNS names as addresses."""
    k, app = cfg.k8s, app_name(cfg)
    ns = k.namespace
    return replace_keys(
        cfg,
        {
            "run.output_dir": f"{k.mount_path.rstrip('/')}/{Path(cfg.run.output_dir).name or 'outputs'}",
            "trainer.distributed.num_processes": k.trainer_pods,
            "trainer.distributed.coordinator_address": f"{app}-trainer-0-0.{app}.{ns}.svc:{k.coordinator_port}",
            "trainer.distributed.process_id": 0,
            "inference.host": "0.0.0.0",
            "inference.port": k.inference_port,
            "orchestrator.client.base_urls": tuple(
                f"http://{app}-inference-{i}.{app}-inference.{ns}.svc:{k.inference_port}"
                for i in range(k.inference_replicas)
            ),
        },
    )


def _env(app: str, *extra: dict[str, Any]) -> list[dict[str, Any]]:
    secret = {
        "name": "PRIMEJAX_ADMIN_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": f"{app}-admin", "key": "token"}},
    }
    return [
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        secret,
        *extra,
    ]


def _label_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _resources(k: K8sConfig, gpus: int) -> dict[str, Any]:
    limits: dict[str, str] = {}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    if k.cpu:
        limits["cpu"] = k.cpu
    if k.memory:
        limits["memory"] = k.memory
    return {"limits": limits, "requests": dict(limits)} if limits else {}


def _pod_spec(cfg: Config, role: str, gpus: int, env: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    k, app = cfg.k8s, app_name(cfg)
    claim = k.volume_claim or f"{app}-run"
    container = {
        "name": role,
        "image": k.image,
        "command": [
            "python",
            "-m",
            "primejax.cluster.k8s_task",
            role,
            "--config",
            f"{CONFIG_MOUNT}/train.json",
        ],
        "env": env,
        "volumeMounts": [
            {"name": "run", "mountPath": k.mount_path},
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    if _resources(k, gpus):
        container["resources"] = _resources(k, gpus)
    if role == "inference":
        container["ports"] = [{"name": "http", "containerPort": k.inference_port}]
        container["readinessProbe"] = {
            "httpGet": {"path": "/liveness", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        }
    if role == "trainer":
        container["ports"] = [{"name": "coordinator", "containerPort": k.coordinator_port}]
    return {
        "containers": [container],
        "volumes": [
            {"name": "run", "persistentVolumeClaim": {"claimName": claim}},
            {"name": "config", "configMap": {"name": f"{app}-config"}},
            {
                "name": "shm",
                "emptyDir": {"medium": "Memory"},
            },  # NCCL and vLLM need more than the 64 MiB default
        ],
        **extra,
    }


def manifests(cfg: Config) -> list[dict[str, Any]]:
    """Every object of the run but its Secret, in the order `kubectl apply` should create them."""
    k, app, inner = cfg.k8s, app_name(cfg), job_config(cfg)
    meta = {"namespace": k.namespace, "labels": {"app.kubernetes.io/part-of": app}}
    out: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{app}-config", **meta},
            "data": {"train.json": inner.to_json()},
        }
    ]
    if not k.volume_claim:
        spec: dict[str, Any] = {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": k.volume_size}},
        }
        if k.storage_class:
            spec["storageClassName"] = k.storage_class
        out.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": f"{app}-run", **meta},
                "spec": spec,
            }
        )
    inference_labels = {"app.kubernetes.io/name": f"{app}-inference"}
    out.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": f"{app}-inference", **meta},
            "spec": {
                "clusterIP": "None",
                "selector": inference_labels,
                "ports": [{"name": "http", "port": k.inference_port, "targetPort": "http"}],
            },
        }
    )
    out.append(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": f"{app}-inference", **meta},
            "spec": {
                "serviceName": f"{app}-inference",
                "replicas": k.inference_replicas,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": inference_labels},
                "template": {
                    "metadata": {"labels": inference_labels},
                    "spec": _pod_spec(cfg, "inference", k.inference_gpus, _env(app)),
                },
            },
        }
    )
    attempt = [
        _label_env("PRIMEJAX_JOBSET_UID", f"metadata.labels['{JOBSET_UID_LABEL}']"),
        _label_env("PRIMEJAX_RESTART_ATTEMPT", f"metadata.labels['{RESTART_LABEL}']"),
    ]
    trainer_env = _env(
        app,
        *attempt,
        _label_env("PRIMEJAX_PROCESS_ID", f"metadata.annotations['{COMPLETION_INDEX}']"),
        {"name": "PRIMEJAX_NUM_PROCESSES", "value": str(k.trainer_pods)},
    )

    def job(name: str, pods: int, gpus: int, env: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "name": name,
            "replicas": 1,
            "template": {
                "spec": {
                    "parallelism": pods,
                    "completions": pods,
                    "completionMode": "Indexed",
                    "backoffLimit": 0,
                    "template": {"spec": _pod_spec(cfg, name, gpus, env, restartPolicy="Never")},
                }
            },
        }

    out.append(
        {
            "apiVersion": JOBSET_API,
            "kind": "JobSet",
            "metadata": {"name": app, **meta},
            "spec": {
                "network": {"enableDNSHostnames": True, "subdomain": app},
                "failurePolicy": {"maxRestarts": k.max_restarts},
                "replicatedJobs": [
                    job("driver", 1, 0, _env(app, *attempt)),
                    job("trainer", k.trainer_pods, k.trainer_gpus, trainer_env),
                ],
            },
        }
    )
    return out


def secret_manifest(cfg: Config, token: str) -> dict[str, Any]:
    app = app_name(cfg)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": f"{app}-admin",
            "namespace": cfg.k8s.namespace,
            "labels": {"app.kubernetes.io/part-of": app},
        },
        "stringData": {"token": token},
    }


def _existing_token(path: Path) -> str | None:
    try:
        return yaml.safe_load(path.read_text())["stringData"]["token"] or None
    except (OSError, TypeError, KeyError, yaml.YAMLError):
        return None


def write_manifests(cfg: Config) -> tuple[Path, Path]:
    """Write `<run>/cluster/k8s.yaml` and `<run>/cluster/k8s-secret.yaml` (0600, its secret kept when present)."""
    from primejax.inference.admin_auth import new_token

    if not cfg.k8s.image:
        raise ConfigError(
            "k8s.image",
            "name the container image with primejax installed (e.g. "
            "--config.k8s.image=registry/primejax:tag)",
        )
    root = Path(cfg.run_dir)
    write_resolved_config(root, "train", cfg.to_json())
    path, secret_path = RunDir(root).cluster("k8s.yaml"), RunDir(root).cluster("k8s-secret.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump_all(manifests(cfg), sort_keys=False))
    token = _existing_token(secret_path) or new_token()
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(yaml.safe_dump(secret_manifest(cfg, token), sort_keys=False))
    return path, secret_path


def generate(cfg: Config) -> int:
    """The `--launcher k8s` entry: write the manifests; the exit status."""
    path, secret = write_manifests(cfg)
    print(
        f"primejax: Kubernetes manifests written to {path} ({cfg.k8s.trainer_pods} trainer pod(s), "
        f"{cfg.k8s.inference_replicas} inference server(s)) and the run's Secret to {secret} (0600)\n"
        f"primejax: kubectl apply -f {secret} -f {path}   (the JobSet controller must be installed: "
        "https://jobset.sigs.k8s.io)\n"
        f"primejax: afterwards, kubectl delete jobset,statefulset,service -l app.kubernetes.io/part-of="
        f"{app_name(cfg)} -n {cfg.k8s.namespace}   (keeps the run's volume)",
        flush=True,
    )
    return 0
