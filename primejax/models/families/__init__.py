"""The model families, one file each; importing this package registers every module of it (families/base.py),
so a new family is its file alone."""

import importlib
import pkgutil

from primejax.models.families.base import FAMILIES, WRAPPERS, Family, family_of, register

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["FAMILIES", "WRAPPERS", "Family", "family_of", "register"]
