"""``--model-fn``/``--data-fn`` specs: ``package.module:function`` or ``FILE.py:function``.

A module is imported by name (found on the worker's path: its workdir, then
PYTHONPATH); a file is imported from where it is, so a user's ``my_model.py``
needs no package or PYTHONPATH. A spec names a file when its part before the
last ``:`` ends in ``.py`` or holds a ``/``; such a file is a path like
``--data`` (``launch.pathargs``): the launcher resolves it per host and the
preflight checks it exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from types import ModuleType


def split(spec: str) -> tuple[str, str]:
    """``(module or file, function)``; ``("", "")`` when ``spec`` has no ``:``."""
    module, sep, attr = spec.rpartition(":")
    return (module, attr) if sep else ("", "")


def is_file(module: str) -> bool:
    """Whether the module part of a spec names a file rather than a module."""
    return module.endswith(".py") or "/" in module


def import_module(module: str) -> ModuleType:
    """The module ``module`` names: imported by name, or loaded from its file (whose
    folder goes first on ``sys.path``, as for ``python FILE``, so its siblings import).
    Raises ImportError naming what is missing."""
    if not is_file(module):
        return importlib.import_module(module)
    path = os.path.abspath(os.path.expanduser(module))
    if not path.endswith(".py"):
        raise ImportError(f"{module} is not a .py file")
    if not os.path.isfile(path):
        raise ImportError(f"no such file {path}")
    name = "autohet_user_" + re.sub(r"\W", "_", os.path.basename(path)[:-3])
    known = sys.modules.get(name)
    if known is not None and getattr(known, "__file__", None) == path:
        return known  # --model-fn and --data-fn from one file: loaded once
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # dataclasses and pickling look a module up by name
    try:
        spec.loader.exec_module(loaded)
    except BaseException:
        del sys.modules[name]
        raise
    return loaded
