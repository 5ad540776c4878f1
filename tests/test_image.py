"""The Docker image, checked without Docker (which cannot run on CI's machines): the tree the
Dockerfile's COPY lines make, installed by the Dockerfile's own `pip install` lines into a fresh
environment, imports every module and every Serve application of configs/serve*.yaml and trains.

The fresh environment sees this environment's packages, standing in for the SGLang image's (torch,
transformers, ...): pip counts them as installed and adds nothing (`venv_over_this_one`)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# RUN lines that check the base image rather than install anything: this environment has no SGLang.
IMAGE_ONLY = ["python -c \"import sglang; v = sglang.__version__; assert v == '0.5.23', v\""]


def dockerfile() -> tuple[str, list[tuple[list[str], str]], list[str]]:
    """(WORKDIR, [(COPY sources, destination)], [RUN commands]), continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    workdir, copies, runs = "/", [], []
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "WORKDIR":
            workdir = rest.strip()
        elif word == "COPY":
            *sources, destination = shlex.split(rest)
            copies.append((sources, destination))
        elif word == "RUN":
            runs.append(" ".join(rest.split()))
    return workdir, copies, runs


def build_tree(where: Path) -> Path:
    """Exactly the paths the COPY lines name, laid out under WORKDIR as the image has them."""
    workdir, copies, _ = dockerfile()
    root = where / workdir.lstrip("/")
    root.mkdir(parents=True)
    for sources, destination in copies:
        target = root / destination
        for source in sources:
            path = ROOT / source
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, target / path.name)
    return root


def test_the_dockerfile_copies_every_top_level_path_the_package_reads():
    _, copies, runs = dockerfile()
    copied = {source.rstrip("/") for sources, _ in copies for source in sources}
    assert {"pyproject.toml", "README.md", "asyncrl", "actors", "configs"} <= copied
    # Every RUN line is either a pip install this test replays or a check of the base image.
    assert all(part.startswith("pip install") for run in runs if run not in IMAGE_ONLY for part in run.split(" && "))


@pytest.mark.slow  # (CI's time: its path is covered by the suite's other tests)
def test_the_tree_the_dockerfile_copies_installs_imports_every_app_and_trains(tmp_path, venv_over_this_one):
    tree = build_tree(tmp_path / "image")
    python = venv_over_this_one / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASYNCRL_CONFIG_DIR")}
    env["PATH"] = f"{venv_over_this_one}:{env['PATH']}"  # `pip` and `python` are the fresh environment's, as in the image
    _, _, runs = dockerfile()
    for run in runs:
        if run not in IMAGE_ONLY:
            subprocess.run(["bash", "-c", run], cwd=tree, env=env, check=True)

    apps = sorted({(app["import_path"], json.dumps(app.get("args", {}))) for spec in (tree / "configs").glob("serve*.yaml")
                   for app in yaml.safe_load(spec.read_text())["applications"]})
    probe = ("import importlib, json, pkgutil, sys, asyncrl, actors\n"
             "for package in (asyncrl, actors):\n"
             "    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
             "        try:\n"
             "            importlib.import_module(module.name)\n"
             "        except ModuleNotFoundError as exc:\n"
             "            if exc.name.split('.')[0] != 'sglang':  # the image's own\n"
             "                raise\n"
             "for path, args in json.loads(sys.argv[1]):\n"
             "    module, name = path.split(':')\n"
             "    app = getattr(importlib.import_module(module), name)(json.loads(args))\n"
             "    print(path, type(app).__name__)\n"
             "print(asyncrl.__file__)\n")
    out = subprocess.run([str(python), "-c", probe, json.dumps(apps)], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    # `serve run` in WORKDIR imports the tree's copy (its --app-dir is "."), `asyncrl` the installed one.
    assert lines[-1].startswith(str(tree)), lines
    assert sorted(line.split()[0] for line in lines[:-1]) == sorted(path for path, _ in apps)
    assert all(line.split()[1] == "Application" for line in lines[:-1])

    train = subprocess.run(["asyncrl", "train", "model=tiny", "task=tiny", "trainer.total_steps=3",
                            f"trainer.run_dir={tmp_path / 'run'}", "trainer.wandb_mode=disabled"],
                           cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
