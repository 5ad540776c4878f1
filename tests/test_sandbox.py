"""The code sandbox: each escape stays contained and the verifier stays healthy after it."""

import json
import os

import pytest

from asyncrl.rewards.sandbox import SandboxLimits, probe_isolation, project_root, run_program
from asyncrl.rewards.verifiers import verify

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=4, memory_mb=256)
needs_namespaces = pytest.mark.skipif(not probe_isolation()["namespaces"],
                                      reason="this machine cannot create namespaces (unshare): network and "
                                             "file hiding are not available, only resource limits")


def run(code, stdin=""):
    return run_program({"main.py": code}, ["python", "main.py"], stdin=stdin, limits=LIMITS)


def still_healthy():
    result = run("print(sum(int(x) for x in input().split()))", "2 3\n")
    assert result.ok and result.stdout.strip() == "5"


def test_plain_program_runs_with_stdin():
    still_healthy()


def test_infinite_loop_times_out():
    result = run("while True:\n    pass")
    assert result.timed_out and not result.ok and result.wall_s < 10
    still_healthy()


def test_fork_bomb_is_contained():
    result = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert not result.ok
    still_healthy()


def test_memory_bomb_fails():
    result = run("x = []\nwhile True:\n    x.append(' ' * 10**7)")
    assert not result.ok and ("MemoryError" in result.stderr or result.returncode != 0)
    still_healthy()


def test_output_is_capped():
    result = run("print('x' * 10**7)")
    assert result.output_truncated and len(result.stdout) <= LIMITS.max_output_bytes


def test_environment_secrets_are_not_inherited(monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", "hunter2")
    result = run("import os\nprint(os.environ.get('ASYNCRL_TEST_SECRET'))\nprint(sorted(os.environ))")
    assert "hunter2" not in result.stdout and result.stdout.startswith("None")


@needs_namespaces
def test_network_is_unreachable():
    result = run("import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=2)\nprint('connected')")
    assert "connected" not in result.stdout and not result.ok


@needs_namespaces
def test_project_files_are_hidden():
    target = os.path.join(project_root(), "pyproject.toml")
    result = run(f"print(open({target!r}).read()[:40])")
    assert not result.ok and "asyncrl" not in result.stdout


@needs_namespaces
def test_writes_outside_the_work_directory_do_not_land(tmp_path):
    outside = os.path.join(project_root(), "sandbox_escape_marker.txt")
    tmp_marker = "/tmp/asyncrl_sandbox_escape_marker"
    result = run(f"open({tmp_marker!r}, 'w').write('x')\ntry:\n    open({outside!r}, 'w').write('x')\n"
                 f"except OSError as e:\n    print('blocked', e)\nopen('inside.txt', 'w').write('ok')\nprint('done')")
    assert "done" in result.stdout
    assert not os.path.exists(outside) and not os.path.exists(tmp_marker)


def test_code_verifier_stdio_and_asserts():
    io_tests = json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3", "12"]})
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(3)\n```"
    v = verify("code", good, io_tests, "plus_minus")
    assert (v.score, v.correct, v.details["pass_fraction"]) == (1.0, True, 1.0)
    v = verify("code", half, io_tests, "plus_minus")
    assert (v.score, v.correct, v.details["pass_fraction"]) == (-1.0, False, 0.5)
    asserts = json.dumps({"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]})
    v = verify("code", "def add(a, b):\n    return a + b\n", asserts)
    assert v.details["passed"] == 2 and v.details["tests"] == 3 and not v.correct
    loop = verify("code", "def add(a, b):\n    while True: pass\n", json.dumps({"asserts": ["assert add(1, 1) == 2"]}),
                  code_limits=SandboxLimits(wall_s=1.0, cpu_s=2))
    assert not loop.correct and loop.details["failures"] == ["timeout"]
    with pytest.raises(ValueError, match="not JSON"):
        verify("code", good, "print(1)")
