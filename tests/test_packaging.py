"""asyncrl as a package: the wheel carries every module and the config recipes, its dependency floors
admit what CI ran, and an installed wheel trains from a directory outside the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_the_listed_packages_are_the_tree_s():
    setuptools = PYPROJECT["tool"]["setuptools"]
    on_disk = {str(d.relative_to(ROOT)).replace("/", ".") for top in ("asyncrl", "actors")
               for d in [ROOT / top, *(ROOT / top).rglob("*")] if d.is_dir() and any(d.glob("*.py"))}
    recipes = {"asyncrl.configs", *(f"asyncrl.configs.{d.name}" for d in (ROOT / "configs").iterdir()
                                    if d.is_dir() and any(d.glob("*.yaml")))}
    assert set(setuptools["packages"]) == on_disk | recipes
    assert setuptools["package-dir"] == {"asyncrl.configs": "configs"}
    assert all(d.joinpath("__init__.py").is_file() for d in (ROOT / "asyncrl", ROOT / "actors") for d in [d, *d.rglob("*")]
               if d.is_dir() and any(d.glob("*.py")))  # no namespace package a wheel would leave out
    assert all(PYPROJECT["tool"]["setuptools"]["package-data"][p] == ["*.yaml"] for p in recipes)


def test_ci_installs_pinned_versions_that_the_floors_admit():
    pins = constraints()
    project = PYPROJECT["project"]
    for spec in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        requirement = Requirement(spec)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not pinned in constraints.txt (`make lock`)"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} outside {spec}"
    if os.environ.get("CI"):  # `make setup` installed from constraints.txt: what runs is what is pinned
        from importlib.metadata import version

        for name in ("torch", "ray", "transformers", "msgspec", "hydra-core"):
            assert version(name).split("+")[0] == pins[name]


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_trains_and_takes_a_config_directory(tmp_path, venv_over_this_one):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("asyncrl-*.whl"))
    python = venv_over_this_one / "python"
    # --no-index: every dependency must already be satisfied by what CI tested, at the wheel's floors.
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", str(wheel)], check=True)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "mine" / "task").mkdir(parents=True)
    # A user's own config directory overrides the packaged recipes and still reaches their groups.
    (elsewhere / "mine" / "task" / "tiny_short.yaml").write_text("defaults:\n  - tiny\n  - _self_\nnum_train_prompts: 48\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASYNCRL_CONFIG_DIR")}
    where = subprocess.run([str(python), "-c", "import asyncrl, actors, asyncrl.config.files as f; "
                            "print(asyncrl.__file__, actors.__file__, f.config_dir())"],
                           cwd=elsewhere, env=env, check=True, capture_output=True, text=True).stdout.split()
    assert all(p.startswith(str(tmp_path / "venv")) for p in where), where
    asyncrl = venv_over_this_one / "asyncrl"
    run = subprocess.run([str(asyncrl), "train", "--config-dir", "mine", "model=tiny", "task=tiny_short",
                          "trainer.total_steps=3", "trainer.run_dir=run", "trainer.wandb_mode=disabled"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads((elsewhere / "run" / "summary.json").read_text())["steps"] == 3
    assert json.loads((elsewhere / "run" / "config.json").read_text())["task"]["num_train_prompts"] == 48
