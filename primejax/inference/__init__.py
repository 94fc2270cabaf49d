"""Inference: a stock vLLM server with primejax's in-place weight updates, its client and process wrapper.

    python -m primejax.inference --config configs/x.py [--config.inference.port=8001]

Importing this package does not import vLLM; only the server process does (through `vllm_ext`).
"""

from primejax.inference.client import Completion, InferenceClient
from primejax.inference.process import InferenceServerProcess, ServerDiedError
from primejax.inference.server import ServerSpec
from primejax.inference.server_pool import InferenceError

__all__ = [
    "Completion",
    "InferenceClient",
    "InferenceError",
    "InferenceServerProcess",
    "ServerDiedError",
    "ServerSpec",
]
