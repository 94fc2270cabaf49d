"""`python -m primejax.eval`: runs primejax/entrypoints/eval.py by name (docs/architecture.md: nothing below the
entry points' floor imports it)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("primejax.entrypoints.eval", run_name="__main__", alter_sys=True)
