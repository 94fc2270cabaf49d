"""The run's admin secret, as every process reads it: `$PRIMEJAX_ADMIN_TOKEN`, else `<run>/admin_token`.

One secret authenticates the server's admin routes (inference/admin_auth.py) and the collective weight
transfer's rendezvous (transports/weights/collective/rendezvous.py); both sides read it from here.
"""

from __future__ import annotations

import os
from pathlib import Path

from primejax.contracts.rundir import RunDir

TOKEN_ENV = "PRIMEJAX_ADMIN_TOKEN"


def read_token(root: str | Path | None = None) -> str | None:
    """The admin secret for a client: $PRIMEJAX_ADMIN_TOKEN, else `<root>/admin_token`, else None."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if root is not None:
        try:
            return RunDir(root).admin_token.read_text().strip() or None
        except OSError:
            return None
    return None
