"""A taskset package that imports but whose loading raises (its data file is missing): the `--dry_run` env
check's test."""

from __future__ import annotations

import verifiers.v1 as vf


class MissingDataTaskset(vf.Taskset):
    def load(self):
        raise FileNotFoundError("tasks.jsonl: the taskset's data file is missing")


__all__ = ["MissingDataTaskset"]
