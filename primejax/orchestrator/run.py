"""The live policy's client from the config sections that name it (the orchestrator process itself:
primejax/entrypoints/orchestrator.py)."""

from __future__ import annotations

import json
from pathlib import Path

from primejax.inference.client import InferenceClient
from primejax.inference.server import InferenceConfig
from primejax.orchestrator.config import ClientConfig
from primejax.utils.sections import ConfigError


def base_urls(client: ClientConfig, inference: InferenceConfig) -> list[str]:
    """`orchestrator.client.base_urls`, or the run's own inference server when that is empty."""
    if client.base_urls:
        return list(client.base_urls)
    if not inference.port:
        raise ConfigError(
            "inference.port",
            "0 (a free port the launcher picks) is not an address: started on its "
            "own, the orchestrator needs the server's port (--config.inference.port=N, the port "
            "`python -m primejax.inference` printed) or orchestrator.client.base_urls",
        )
    return [f"http://{inference.host}:{inference.port}"]


def model_vocab_size(model_path: str) -> int | None:
    """The policy's vocabulary size from its config.json (None when it cannot be read)."""
    try:
        vocab = json.loads((Path(model_path) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def policy_client(
    client: ClientConfig,
    inference: InferenceConfig,
    vocab_size: int | None = None,
    admin_token: str | None = None,
) -> InferenceClient:
    """The live policy's client; with `vocab_size`, answers with token ids outside the vocabulary are rejected."""
    return InferenceClient(
        base_urls(client, inference),
        timeout_s=client.timeout_s,
        max_retries=client.max_retries,
        vocab_size=vocab_size,
        admin_token=admin_token,
        api_key_var=client.api_key_env,
    )
