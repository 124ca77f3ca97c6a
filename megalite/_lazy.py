"""PEP 562 lazy exports for package `__init__` files.

A package lists its public names per module; each is imported on first use. So
`import megalite.plan` (pure arithmetic) does not load torch through `megalite/__init__.py`,
and `import megalite` stays cheap whatever it exports.

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"megalite.distributed.mesh": ["init_mesh", ...]})
"""
from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, list[str]]):
    """(__getattr__, __dir__, __all__) for `package`: each name loads its module when first read."""
    module_of = {name: module for module, names in exports.items() for name in names}
    names = sorted(module_of)

    def __getattr__(name: str):
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_of[name]), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this function
        return value

    def __dir__():
        return names

    return __getattr__, __dir__, names
