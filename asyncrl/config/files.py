"""Where the YAML recipes are: `configs/` of the source tree, or ASYNCRL_CONFIG_DIR."""

from __future__ import annotations

import os
from pathlib import Path


def config_dir() -> str:
    """`configs/` of the source tree (editable install), or ASYNCRL_CONFIG_DIR."""
    env = os.environ.get("ASYNCRL_CONFIG_DIR")
    if env:
        return os.path.abspath(env)
    return str(Path(__file__).resolve().parents[2] / "configs")


def config_groups() -> dict[str, list[str]]:
    """Config group -> its options (the YAML files of `configs/<group>/`)."""
    root = Path(config_dir())
    return {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in root.iterdir() if d.is_dir()}
