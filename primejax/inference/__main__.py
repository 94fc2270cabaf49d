"""`python -m primejax.inference`: runs primejax/entrypoints/inference.py by name (docs/architecture.md: nothing below the
entry points' floor imports it)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("primejax.entrypoints.inference", run_name="__main__", alter_sys=True)
