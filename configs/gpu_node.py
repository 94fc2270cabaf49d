"""RL on a node of 4 GPUs (docs/gpu.md): the trainer on GPUs 0-1 (FSDP over both), two vLLM replicas on GPUs 2
and 3, weights sent collectively (NCCL, from the trainer's GPU into every replica's worker, no file), continuous
rollouts spread over both replicas with AIMD concurrency on their /metrics. Same model and task as
configs/gpu_single.py.

    python -m primejax.train --config configs/gpu_node.py

For a node of 8: `--config.trainer.devices=0,1,2,3 --config.inference.devices=4,5,6,7` with 4 replicas, or 2
replicas of tensor parallel 2 (`--config.inference.tensor_parallel_size=2`).
"""

from pathlib import Path

from primejax.config.cli import load_config_file


def get_config():
    c = load_config_file(Path(__file__).with_name("gpu_single.py"))
    c.run.name = "gpu_node"
    c.trainer.devices = "0,1"
    c.inference.devices = "2,3"
    c.inference.replicas = 2
    c.trainer.broadcast.mode = "collective"
    return c
