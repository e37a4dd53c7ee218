"""Lazy package exports: a public name's module is imported on first use, not at import time."""

import importlib
from typing import Callable, Dict, Tuple


def lazy_exports(package: str, modules: Dict[str, str], namespace: dict) -> Tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: name -> ``package.modules[name]``, cached in ``namespace``."""

    def __getattr__(name):
        module_name = modules.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module_name}"), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(modules)

    return __getattr__, __dir__
