"""The launcher tests drive real runs through the fault suite's harness (tests/faults/fault_harness.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
