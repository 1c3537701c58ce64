"""Post-import hooks: run a function the moment a module finishes importing (stdlib only).

verl imports its plugins from inside ``verl/__init__.py``; at that moment most of
verl is not importable yet, so every claas_verl registration into verl is
scheduled here and runs right after the verl module it touches is imported (or
at once, when it already is). ``import claas_verl`` uses the same mechanism, so
it stays light (no verl import) and the registrations still exist in any
process that later imports verl.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable

_HOOKS: dict[str, list[Callable[[object], None]]] = {}
_LOCK = threading.Lock()


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of hooked module names so hooks run after the module body executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader)
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._inner  # keep inspect/pkgutil working on the real loader
        self._inner.exec_module(module)
        _run_hooks(module.__name__, module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _run_hooks(name: str, module) -> None:
    with _LOCK:
        hooks = _HOOKS.pop(name, [])
    for hook in hooks:
        hook(module)


_FINDER = _PostImportFinder()


def when_imported(module_name: str, hook: Callable[[object], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (now, if it already is)."""
    module = sys.modules.get(module_name)
    spec = getattr(module, "__spec__", None)
    if module is not None and not getattr(spec, "_initializing", False):
        hook(module)
        return
    with _LOCK:
        _HOOKS.setdefault(module_name, []).append(hook)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


