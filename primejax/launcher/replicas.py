"""Several inference servers on one node (`inference.replicas = N`): one spec per replica, each with its own
port and its share of the node's accelerators, started and supervised by the launcher like the single server.

Replica 0 keeps the process name `inference` (its log `logs/inference.log`); replica i > 0 is `inference_i`.
Ports: `inference.port + i` (each checked free before anything starts), or a free port each when
`inference.port = 0`. Devices: `inference.devices` split into N equal consecutive groups ('' = every replica
sees every device, as on a CPU node). The orchestrator is pointed at all of them through
`orchestrator.client.base_urls` (unless that names servers itself); its client keeps each rollout on one
replica and sends weight updates to every replica (docs/rollouts.md#several-inference-servers).
"""

from __future__ import annotations

from dataclasses import dataclass

from primejax.inference.server import InferenceConfig
from primejax.launcher.preflight import PreflightError
from primejax.launcher.runlock import check_port


@dataclass(frozen=True)
class ReplicaSpec:
    index: int
    host: str
    port: int
    devices: str

    @property
    def name(self) -> str:
        return "inference" if self.index == 0 else f"inference_{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def split_devices(devices: str, n: int) -> list[str]:
    """`devices` ("0,1,2,3") in `n` equal consecutive groups; '' stays '' for every replica."""
    if not devices:
        return [""] * n
    ids = [d.strip() for d in devices.split(",") if d.strip()]
    if len(ids) % n:
        raise PreflightError("inference.devices", f"{len(ids)} devices do not split evenly over {n} replicas")
    k = len(ids) // n
    return [",".join(ids[i * k : (i + 1) * k]) for i in range(n)]


def replica_specs(inf: InferenceConfig) -> list[ReplicaSpec]:
    """One spec per replica, each port checked bindable now (PreflightError naming the key otherwise)."""
    devices = split_devices(inf.devices, inf.replicas)
    specs: list[ReplicaSpec] = []
    for i in range(inf.replicas):
        wanted = 0 if inf.port == 0 else inf.port + i
        port = check_port(inf.host, wanted)
        while port in {s.port for s in specs}:  # a free-port pick may repeat one handed out a moment ago
            port = check_port(inf.host, 0)
        specs.append(ReplicaSpec(index=i, host=inf.host, port=port, devices=devices[i]))
    return specs
