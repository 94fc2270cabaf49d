"""Which GPU each part of the GPU tier uses (imported by tests/gpu/conftest.py and the tests beside it).

GPU 0 belongs to the test process (JAX allocating on demand, the collective sender's torch) and to the launcher's
run (its server and trainer share that GPU's memory: 45% each); the session's server goes on GPU 1 (NCCL cannot
join two processes on one GPU). On a one-GPU node the tests that need two GPUs skip.
"""

from __future__ import annotations

import os

from primejax.launcher.placement import node_gpu_count

GPUS = node_gpu_count()
SERVER_GPU = "1" if GPUS >= 2 else "0"
RUN_GPU = "0"

# This process's JAX shares GPU 0 with the collective sender's torch: allocate on demand, never 75% up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_var, _value)  # never NVLink multicast (docs/gpu.md)
