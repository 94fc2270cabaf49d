"""A taskset package whose own import fails on a missing dependency (the `--dry_run` env check's test)."""

import primejax_missing_dependency  # noqa: F401  # not installed: the import error is the env's problem
import verifiers.v1 as vf  # noqa: F401
