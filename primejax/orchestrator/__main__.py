"""`python -m primejax.orchestrator`: runs primejax/entrypoints/orchestrator.py by name (docs/architecture.md: nothing below the
entry points' floor imports it)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("primejax.entrypoints.orchestrator", run_name="__main__", alter_sys=True)
