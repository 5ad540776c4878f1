"""Where the YAML recipes are: the package's own (`configs/` of the source tree, shipped in the wheel
as `asyncrl.configs`), or ASYNCRL_CONFIG_DIR; plus a user's directory (`--config-dir`) searched first."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path


def config_dir() -> str:
    """The package's recipes: ASYNCRL_CONFIG_DIR, else `configs/` beside the package in a source
    tree, else the copy installed with the package (`asyncrl.configs`)."""
    env = os.environ.get("ASYNCRL_CONFIG_DIR")
    if env:
        return os.path.abspath(env)
    source_tree = Path(__file__).resolve().parents[2] / "configs"
    if (source_tree / "config.yaml").is_file():
        return str(source_tree)
    return str(resources.files("asyncrl.configs"))


def config_groups(user_dir: str | None = None) -> dict[str, list[str]]:
    """Config group -> its options (the YAML files of `<dir>/<group>/`, the user's directory's too)."""
    groups: dict[str, set[str]] = {}
    for root in [Path(config_dir()), *([Path(user_dir)] if user_dir else [])]:
        for d in root.iterdir():
            if d.is_dir() and not d.name.startswith(("_", ".")):
                groups.setdefault(d.name, set()).update(f.stem for f in d.glob("*.yaml"))
    return {group: sorted(options) for group, options in groups.items() if options}
