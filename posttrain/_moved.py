"""Old import paths of modules that moved (docs/architecture.md, "Moved"), kept for code written against them.

`import posttrain.data.builtin` gives the module `posttrain.tasks.builtin` itself (one module, one set of
globals), so README examples and user scripts keep working. Only modules that user-facing docs showed are
listed; inside posttrain every import uses the new path (tests/test_architecture.py checks it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util

MOVED = {
    "posttrain.data.builtin": "posttrain.tasks.builtin",
    "posttrain.rollout.environments": "posttrain.tasks.environments",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self._specs = {}  # new name -> the module's own spec, which the import system overwrites with the old one

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self._specs[module.__name__]  # it is already executed; keep its own spec


def install() -> None:
    import sys

    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())
