"""Load a repository script (a benchmark, an example, a deploy check) as a module in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str, *, register: bool = False) -> ModuleType:
    """Execute the file at ``path`` as a module called ``name``.

    ``register`` puts it in ``sys.modules`` under ``name`` before it runs (a script whose
    dataclasses or msgspec structs are looked up by module name needs that).
    """
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
