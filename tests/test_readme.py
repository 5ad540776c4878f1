"""Every command of the README, checked as written without running the long ones: each `asyncrl`
line parses and its config composes, each `make` target, load-test script and flag exists, each
Serve application of `configs/serve.yaml` composes and each URL names a route that is there.
`load_tests/readme_commands.py` runs them (the short ones in CI time, all of them with --all)."""

import functools
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "load_tests"))

from readme_commands import readme_commands  # noqa: E402


def test_the_readme_starts_with_the_two_commands():
    assert readme_commands()[:2] == ["make demo", "make test"]
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert re.search(r"^demo: setup$", makefile, re.M) and re.search(r"^test: setup( |$)", makefile, re.M)
    assert "make test" in open(os.path.join(ROOT, ".ci", "run")).read()


@pytest.mark.parametrize("line", [c for c in readme_commands() if ".venv/bin/asyncrl " in c])
def test_every_asyncrl_command_parses_and_its_config_composes(line):
    from asyncrl.bench import BENCHMARKS
    from asyncrl.cli import parse
    from asyncrl.config import compose

    argv = shlex.split(line.split(".venv/bin/asyncrl ", 1)[1])
    args = parse(argv)
    if args.command == "bench":
        assert args.name in BENCHMARKS
    elif args.command != "export":
        compose(args.overrides)


@functools.cache
def help_of(script: str) -> subprocess.CompletedProcess:
    """`script --help`, once per script: the README runs some scripts several ways, and a script
    that imports Ray and torch takes seconds to answer."""
    return subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("line", [c for c in readme_commands() if "load_tests/" in c])
def test_every_load_test_and_flag_exists(line):
    words = shlex.split(line)
    script = next(w for w in words if w.startswith("load_tests/"))
    out = help_of(script)
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in (w for w in words[words.index(script) + 1:] if w.startswith("--")):
        assert flag in out.stdout, (script, flag)


def test_serve_yaml_applications_compose_and_the_readme_urls_exist():
    import yaml

    from asyncrl.config import compose

    for name in ("serve.yaml", "serve_embedded.yaml"):
        spec = yaml.safe_load(open(os.path.join(ROOT, "configs", name)))
        assert [a["name"] for a in spec["applications"]] == ["train", "policy", "reward-verifier"]
        for app in spec["applications"]:
            compose(app["args"]["overrides"].split())
    # The routes as declared on each application (Serve adds the class's routes at deploy time).
    prefixes = {"train": "/train", "policy": "/v1", "reward": "/reward/verifier"}
    source = "".join(open(os.path.join(ROOT, "asyncrl", "serve", f"{app}.py")).read() for app in prefixes)
    routes = {prefixes[app] + path for app, path in re.findall(r'@(\w+)_api\.(?:get|post)\("([^"]+)"', source)}
    text = open(os.path.join(ROOT, "README.md")).read()
    for path in re.findall(r"127\.0\.0\.1:8000(/[\w/]*)", text):
        if path not in ("/v1", "/train/"):  # the policy's base URL and the status page
            assert path in routes or path.rstrip("/") in routes, path


def _map_of_the_tree() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index("## Map of the tree")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_the_map_of_the_tree_names_every_package_and_module_and_nothing_that_is_gone():
    """Each package of `asyncrl/` and `actors/` has its row, and each module is named in its package's
    row (`name.py`); each path and `name.py` the map gives exists."""

    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)`[^|]*\| (.*) \|$", _map_of_the_tree(), re.M)}
    missing = []
    for package in ["actors", "asyncrl", *sorted(str(p.parent.relative_to(ROOT)) for p in
                                                   pathlib.Path(ROOT, "asyncrl").glob("*/__init__.py"))]:
        row = rows.get(f"{package}/")  # `asyncrl/` is the row of the modules at its top
        if row is None:
            missing.append(f"{package}/ has no row")
            continue
        for module in sorted(pathlib.Path(ROOT, package).glob("*.py")):
            if module.name != "__init__.py" and f"`{module.name}`" not in row:
                missing.append(f"{package}/{module.name} is not in its row")
        for named in re.findall(r"`([\w]+\.py)`", row):
            if not pathlib.Path(ROOT, package, named).exists():
                missing.append(f"{package}/{named} is named but does not exist")
    for path in rows:
        if not os.path.exists(os.path.join(ROOT, path)):
            missing.append(f"{path} is in the map but not in the tree")
    assert not missing, "\n".join(missing)
