"""Code of the user's that asyncrl loads by name: a reward function (`reward.endpoints.<name>.path`,
`.function`) or an environment class (`environment.class_path`), from a `.py` file (its directory on
the path, so that it can import its neighbours) or an importable module."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys


def load_attribute(path: str, name: str, what: str = "function"):
    """`name` of the file or module `path`; a missing file, module or name is an error that says
    what is there."""
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{what} file {path} does not exist")
        directory = os.path.dirname(os.path.abspath(path))
        if directory not in sys.path:
            sys.path.insert(0, directory)
        module_name = f"asyncrl_user_{hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    found = getattr(module, name, None)
    if found is None:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"{path} has no {what} {name!r} (it has: {', '.join(names) or 'nothing callable'})")
    return found


def split_class_path(class_path: str) -> tuple[str, str]:
    """`package.module:Class` or `path/to/file.py:Class` -> (path, Class)."""
    path, sep, name = class_path.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"{class_path!r} is not `package.module:Class` or `file.py:Class`")
    return path, name
