"""Code verifier: run a response's program against unit tests in the sandbox.

Ground truth (a JSON string, as code RL datasets in verl's layout carry it) is one of:
* `{"inputs": [...], "outputs": [...]}`: stdin/stdout cases; output compared line by line with
  trailing whitespace ignored;
* `{"asserts": ["assert f(1) == 2", ...]}`: each assert runs after the program, separately;
* `{"test_code": "..."}`: one test program run after the program (all or nothing).
The score is the all-pass indicator; the per-test pass fraction is reported too.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from asyncrl.rewards.sandbox import SandboxLimits, run_program

_FENCE = re.compile(r"```(?:python|py|Python3|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block, or the whole response when there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


@dataclass
class CodeVerdict:
    passed: int
    total: int
    details: list[str]

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def pass_fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def parse_tests(ground_truth: str) -> dict:
    try:
        tests = json.loads(ground_truth)
    except json.JSONDecodeError as exc:
        raise ValueError(f"code ground truth is not JSON: {exc}") from exc
    if not isinstance(tests, dict) or not ({"inputs", "asserts", "test_code"} & tests.keys()):
        raise ValueError("code ground truth needs `inputs`/`outputs`, `asserts` or `test_code`")
    if "inputs" in tests and len(tests["inputs"]) != len(tests.get("outputs", [])):
        raise ValueError("code ground truth: `inputs` and `outputs` differ in length")
    return tests


def _same_output(got: str, expected: str) -> bool:
    return [line.rstrip() for line in got.strip().splitlines()] == [line.rstrip() for line in str(expected).strip().splitlines()]


def run_tests(code: str, tests: dict, limits: SandboxLimits = SandboxLimits(), max_tests: int = 16,
              parallel: int = 2) -> CodeVerdict:
    jobs = []
    if "inputs" in tests:
        for stdin, expected in list(zip(tests["inputs"], tests["outputs"]))[:max_tests]:
            jobs.append(("io", {"main.py": code}, str(stdin), expected))
    if "asserts" in tests:
        for assertion in tests["asserts"][:max_tests]:
            jobs.append(("assert", {"main.py": f"{code}\n\n{assertion}\n"}, "", None))
    if "test_code" in tests:
        jobs.append(("assert", {"main.py": f"{code}\n\n{tests['test_code']}\n"}, "", None))

    def run_one(job) -> tuple[bool, str]:
        kind, files, stdin, expected = job
        result = run_program(files, ["python", "main.py"], stdin=stdin, limits=limits)
        if result.timed_out:
            return False, "timeout"
        if result.returncode != 0:
            return False, (result.stderr.strip().splitlines() or ["exit %s" % result.returncode])[-1][:200]
        if kind == "io" and not _same_output(result.stdout, expected):
            return False, "wrong output"
        return True, "ok"

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        outcomes = list(pool.map(run_one, jobs))
    return CodeVerdict(passed=sum(ok for ok, _ in outcomes), total=len(outcomes), details=[d for _, d in outcomes])
