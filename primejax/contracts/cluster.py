"""The `slurm` and `k8s` config sections: what a run asks of a scheduler (docs/multinode.md). Both sides read
them: the command that writes the job (primejax/cluster/slurm.py, k8s.py) and the processes inside it
(primejax/cluster/slurm_job.py, k8s_task.py)."""

from __future__ import annotations

import re

from primejax.utils.sections import ConfigError, Section, option, section

CONFIG_MOUNT = "/etc/primejax"  # where a Kubernetes pod finds the run's config (the ConfigMap)
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # sbatch --time: minutes, [D-]HH:MM[:SS]
_WORD = re.compile(r"^[A-Za-z0-9_.,:=@%+/-]*$")  # partition, account, qos: no spaces or shell characters
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")


@section
class SlurmConfig(Section):
    """`slurm`: the job `python -m primejax.train --launcher slurm` writes (docs/multinode.md)."""

    trainer_nodes: int = option(
        1, "nodes of trainer ranks (the orchestrator runs beside rank 0)", gt=0, le=4096
    )
    trainer_tasks_per_node: int = option(
        1,
        "trainer processes per node: 1 on GPUs (one JAX process owns a node's GPUs); more on CPU",
        gt=0,
        le=64,
    )
    inference_nodes: int = option(
        1,
        "nodes with inference.replicas servers each (inference.tensor_parallel_size GPUs per server); "
        "0 = the servers share the first trainer node (inference.devices / trainer.devices split it)",
        ge=0,
        le=4096,
    )
    gpus_per_node: int = option(
        0, "GPUs asked per node (--gpus-per-node); 0 = none asked (CPU nodes)", ge=0, le=64
    )
    cpus_per_task: int = option(1, "CPUs per task (--cpus-per-task)", gt=0, le=1024)
    coordinator_port: int = option(
        29500, "jax.distributed coordinator port on the first trainer node", gt=0, le=65535
    )
    inference_port: int = option(8000, "each inference server's port on its node", gt=0, le=65535)
    partition: str = option("", "--partition ('' = the cluster's default)")
    account: str = option("", "--account ('' = none)")
    qos: str = option("", "--qos ('' = none)")
    time: str = option("", "--time limit, minutes or [D-]HH:MM[:SS] ('' = the partition's)")
    exclusive: bool = option(True, "--exclusive: whole nodes (no other job on the run's GPUs)")
    python: str = option("", "the interpreter every task runs ('' = the one that wrote the script)")
    setup: tuple = option((), "shell lines run before the job (module load ..., source venv/bin/activate)")
    extra_args: tuple = option((), "more #SBATCH options, e.g. ('--constraint=h100',)")

    def check(self) -> None:
        for key in ("partition", "account", "qos"):
            if not _WORD.match(getattr(self, key)):
                raise ConfigError(
                    key, f"must be one word without spaces or shell characters, got {getattr(self, key)!r}"
                )
        if self.time and not _TIME.match(self.time):
            raise ConfigError(
                "time", f"must be minutes or [D-]HH:MM[:SS] as sbatch reads it, got {self.time!r}"
            )
        if self.gpus_per_node and self.trainer_tasks_per_node > 1:
            raise ConfigError(
                "trainer_tasks_per_node", "must be 1 on GPU nodes: one JAX process owns a node's GPUs"
            )
        if self.coordinator_port == self.inference_port:
            raise ConfigError("coordinator_port", f"is also slurm.inference_port ({self.inference_port})")
        for arg in self.extra_args:
            if not (isinstance(arg, str) and arg.startswith("--") and "\n" not in arg):
                raise ConfigError("extra_args", f"each must be one '--option[=value]' of sbatch, got {arg!r}")
        for line in self.setup:
            if not isinstance(line, str) or "\n" in line:
                raise ConfigError("setup", f"each must be one shell line, got {line!r}")

    @property
    def nodes(self) -> int:
        return self.trainer_nodes + self.inference_nodes

    @property
    def trainer_tasks(self) -> int:
        return self.trainer_nodes * self.trainer_tasks_per_node


@section
class K8sConfig(Section):
    """`k8s`: the manifests `python -m primejax.train --launcher k8s` writes (docs/multinode.md)."""

    namespace: str = option("default", "namespace of every object")
    image: str = option("", "container image with primejax installed (required)")
    trainer_pods: int = option(
        1, "trainer processes, one pod each (one JAX process owns a node's GPUs)", gt=0, le=4096
    )
    trainer_gpus: int = option(0, "GPUs per trainer pod (nvidia.com/gpu); 0 = CPU", ge=0, le=64)
    inference_replicas: int = option(1, "vLLM servers, one pod each", gt=0, le=4096)
    inference_gpus: int = option(
        0, "GPUs per server pod; set it to inference.tensor_parallel_size", ge=0, le=64
    )
    cpu: str = option("", "CPU request and limit of each pod ('' = none)")
    memory: str = option("", "memory request and limit of each pod, e.g. '512Gi' ('' = none)")
    volume_claim: str = option("", "an existing ReadWriteMany claim for the run directory ('' = create one)")
    volume_size: str = option("1Ti", "size of the created claim")
    storage_class: str = option("", "storage class of the created claim ('' = the cluster's default)")
    mount_path: str = option("/primejax", "where every pod mounts the run volume (run.output_dir below it)")
    coordinator_port: int = option(29500, "jax.distributed coordinator port on trainer pod 0", gt=0, le=65535)
    inference_port: int = option(8000, "each server's port", gt=0, le=65535)
    max_restarts: int = option(3, "JobSet restarts (all pods, resuming) after a pod failed", ge=0, le=1000)
    start_timeout_s: int = option(1800, "how long a trainer pod waits for the driver's configs", gt=0)

    def check(self) -> None:
        for key in ("namespace", "volume_claim", "storage_class"):
            value = getattr(self, key)
            if value and not (_DNS_LABEL.match(value) and len(value) <= 63):
                raise ConfigError(key, f"must be a DNS label (a-z, 0-9, '-'), got {value!r}")
        for key in ("cpu", "memory", "volume_size"):
            value = getattr(self, key)
            if value and not _QUANTITY.match(value):
                raise ConfigError(
                    key, f"must be a Kubernetes quantity like '8', '0.5' or '512Gi', got {value!r}"
                )
        if not self.mount_path.startswith("/") or self.mount_path.rstrip("/") in ("", CONFIG_MOUNT):
            raise ConfigError("mount_path", f"must be an absolute path other than / and {CONFIG_MOUNT}")
        if self.coordinator_port == self.inference_port:
            raise ConfigError("coordinator_port", f"is also k8s.inference_port ({self.inference_port})")
