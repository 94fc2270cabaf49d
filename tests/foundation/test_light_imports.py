"""Reading a config and starting the launcher import no JAX, torch or transformers.

`python -m primejax.train --dry_run` reports a broken environment before anything heavy loads (issue 28 asks for
under 10 s); the config sections live apart from the code that needs JAX (e.g. `models/lora_config.py`) for that.
"""

import subprocess
import sys

HEAVY = ("jax", "flax", "optax", "torch", "transformers")


def test_config_and_launcher_import_nothing_heavy():
    code = (
        "import sys; import primejax.config, primejax.config.cli, primejax.train, primejax.entrypoints.train, "
        f"primejax.launcher.launch, primejax.launcher.envcheck; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "", f"imported at config/launch time: {out.stdout.strip()}"
