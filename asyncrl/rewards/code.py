"""Code verifier: run a response's program against unit tests in the sandbox, with a result the
program cannot forge.

Ground truth (a JSON string, as code RL datasets in verl's layout carry it) is one of:
* `{"inputs": [...], "outputs": [...]}`: stdin/stdout cases, one sandbox run each; output compared
  here, line by line with trailing whitespace ignored;
* `{"asserts": ["assert f(1) == 2", ...]}`: each assert is one test;
* `{"test_code": "..."}`: one test program (all or nothing).
The score is the all-pass indicator; the per-test pass fraction is reported too.

Asserts and test programs run in one sandbox run under `code_harness` (its docstring says what it
guards against). Each assert is split here: `assert E == 3` sends only `E` into the sandbox and
keeps 3 here, so the comparison happens where the program cannot reach; `assert not E` and
`assert E` likewise compare E's value with falsy/truthy here. A test that did not report is a
failure with a reason; conduct that only a reward hack has (the program ended cleanly before the
tests did, a test exited the interpreter, a test returned a fake value, forged records) is named
in `suspicious`, which the metrics count.
"""

from __future__ import annotations

import ast
import contextvars
import json
import operator
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from asyncrl.rewards.sandbox import SandboxLimits, run_program

_FENCE = re.compile(r"```(?:python|py|Python3|python3)?[ \t]*\n(.*?)```", re.DOTALL)
HARNESS_SOURCE = open(os.path.join(os.path.dirname(__file__), "code_harness.py"), encoding="utf-8").read()

_OPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
        ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


def extract_code(response: str) -> str:
    """The last fenced code block, or the whole response when there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


@dataclass
class CodeReport:
    passed: int
    total: int
    details: list[str]
    suspicious: list[str] = field(default_factory=list)  # reward-hacking conduct seen, by name

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


@dataclass
class HarnessTest:
    """One test as the harness sees it (`kind`, `source`) and the check that stays here."""

    kind: str  # value: evaluate `source`, report its value | program: run `source`, report completion
    source: str
    check: tuple = ()  # ("compare", op, expected, literal_on_left) | ("truthy",) | ("falsy",) | () for programs


def _literal(node: ast.AST):
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def plan_assert(assertion: str) -> HarnessTest:
    """`assert E op literal` -> evaluate E inside, compare here; `assert not E` / `assert E` ->
    evaluate E inside, falsy/truthy here; anything else runs whole inside as a program."""
    try:
        tree = ast.parse(assertion)
    except SyntaxError:
        return HarnessTest("program", assertion)
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return HarnessTest("program", assertion)
    test = tree.body[0].test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _OPS:
        left_is, left = _literal(test.left)
        right_is, right = _literal(test.comparators[0])
        if right_is and not left_is:
            return HarnessTest("value", ast.unparse(test.left), ("compare", type(test.ops[0]), right, False))
        if left_is and not right_is:
            return HarnessTest("value", ast.unparse(test.comparators[0]), ("compare", type(test.ops[0]), left, True))
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return HarnessTest("value", ast.unparse(test.operand), ("falsy",))
    return HarnessTest("value", ast.unparse(test), ("truthy",))


def decode(data):
    """The harness's tagged JSON back into plain Python values (built here, so nothing in them runs
    code of the candidate's)."""
    if data is None or isinstance(data, bool):
        return data
    (tag, body), = data.items()
    if tag == "i":
        return int(body)
    if tag == "f":
        return float(body)
    if tag == "c":
        return complex(float(body[0]), float(body[1]))
    if tag == "s":
        return str(body)
    if tag == "y":
        return bytes.fromhex(body)
    if tag == "d":
        return {decode(k): decode(v) for k, v in body}
    items = [decode(v) for v in body]
    return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)


def judge_value(check: tuple, value) -> tuple[bool, str]:
    kind = check[0]
    if kind == "truthy":
        return (True, "ok") if value else (False, "assertion failed")
    if kind == "falsy":
        return (True, "ok") if not value else (False, "assertion failed")
    _, op, expected, literal_on_left = check
    try:
        ok = _OPS[op](expected, value) if literal_on_left else _OPS[op](value, expected)
    except Exception as exc:  # e.g. None < 3
        return False, f"comparison failed: {type(exc).__name__}"
    return (True, "ok") if ok else (False, f"wrong value: got {repr(value)[:80]}")


def _payload(text: str) -> str:
    try:
        return str(json.loads(text))[:300]
    except ValueError:
        return text[:300]


def _run_harness(code: str, planned: list[HarnessTest], limits: SandboxLimits) -> tuple[list[tuple[bool, str]], list[str]]:
    """Run every planned test in one sandbox run; per test (passed, reason), and suspicious conduct."""
    nonce = secrets.token_hex(16)
    per_test_s = limits.wall_s
    # The whole run may take a few tests' worth of time; each test alone at most wall_s.
    wall = limits.wall_s * min(len(planned), 3) + 1.0
    run_limits = SandboxLimits(**{**limits.__dict__, "wall_s": wall, "cpu_s": int(wall) + 2})
    files = {"harness.py": HARNESS_SOURCE, "solution.py": code,
             "tests.json": json.dumps({"per_test_s": per_test_s,
                                       "tests": [{"kind": t.kind, "source": t.source} for t in planned]})}
    result = run_program(files, ["python", "-I", "-S", "harness.py"], stdin=nonce + "\n", limits=run_limits)
    suspicious: set[str] = set()
    report = _read_report(result.stdout, nonce, len(planned), suspicious)
    outcomes = [_outcome(test, report.records.get(index, ("missing", "")), report, result, suspicious)
                for index, test in enumerate(planned)]
    return outcomes, sorted(suspicious)


@dataclass
class _HarnessReport:
    records: dict[int, tuple[str, str]]  # test index -> (status, payload)
    loaded: bool = False
    done: bool = False
    load_failure: str = ""


def _read_report(stdout: str, nonce: str, planned: int, suspicious: set[str]) -> _HarnessReport:
    """The harness's lines (each opens with the nonce only it knows); any other line, or a second
    line for one test, is the candidate forging the report."""
    report = _HarnessReport(records={})
    for line in stdout.splitlines():
        head, _, rest = line.partition(" ")
        if head != nonce:
            suspicious.add("forged_report")  # the candidate wrote on the harness's channel
            continue
        what, _, payload = rest.partition(" ")
        if what == "loaded":
            report.loaded = True
        elif what == "done":
            report.done = True
        elif what == "load_exit":
            report.load_failure = "the program exited while loading"
            suspicious.add("early_exit")
        elif what == "load_error":
            report.load_failure = f"the program failed to load: {_payload(payload)}"
        elif what.isdigit():
            index = int(what)
            if index in report.records or index >= planned:
                suspicious.add("forged_report")  # only a holder of the nonce could write this
                report.records[index] = ("forged", "")
                continue
            status, _, value = payload.partition(" ")
            report.records[index] = (status, value)
    return report


def _outcome(test: HarnessTest, record: tuple[str, str], report: _HarnessReport, result,
             suspicious: set[str]) -> tuple[bool, str]:
    """One test's (passed, reason) from its record in the report."""
    status, payload = record
    if status == "value" and test.kind == "value":
        try:
            return judge_value(test.check, decode(json.loads(payload)))
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            suspicious.add("forged_report")
            return False, f"unreadable value: {type(exc).__name__}"
    if status == "completed" and test.kind == "program":
        return True, "ok"
    if status == "error":
        return False, _payload(payload)
    if status == "not_plain":
        suspicious.add("fake_value")
        return False, f"fake value: the test got {_payload(payload)}"
    if status == "exit":
        suspicious.add("exit_during_test")
        return False, "the test exited the interpreter"
    if status == "timeout":
        return False, "timeout"
    if report.load_failure:
        return False, report.load_failure
    if result.timed_out:
        return False, "timeout"
    if result.returncode == 0 and not report.done:
        suspicious.add("early_exit")  # only an exit call ends the harness cleanly before it is done
    why = "the program ended before this test ran" if report.loaded else "the program never loaded"
    tail = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1][:200]
    return False, f"{why} ({tail})"


def run_tests(code: str, tests: dict, limits: SandboxLimits = SandboxLimits(), max_tests: int = 16,
              parallel: int = 2) -> CodeReport:
    outcomes: list[tuple[bool, str]] = []
    suspicious: set[str] = set()
    planned = [plan_assert(a) for a in tests.get("asserts", [])[:max_tests]]
    if "test_code" in tests:
        planned.append(HarnessTest("program", tests["test_code"]))
    if planned:
        harness_outcomes, flags = _run_harness(code, planned, limits)
        outcomes += harness_outcomes
        suspicious.update(flags)
    if "inputs" in tests:
        def run_io(case) -> tuple[bool, str]:
            stdin, expected = case
            result = run_program({"main.py": code}, ["python", "main.py"], stdin=str(stdin), limits=limits)
            if result.timed_out:
                return False, "timeout"
            if result.returncode != 0:
                return False, (result.stderr.strip().splitlines() or ["exit %s" % result.returncode])[-1][:200]
            if not _same_output(result.stdout, expected):
                return False, "wrong output"
            return True, "ok"

        cases = list(zip(tests["inputs"], tests["outputs"]))[:max_tests]
        # Each case in this thread's context: its reward call, whose stop kills the case's sandbox.
        contexts = [contextvars.copy_context() for _ in cases]
        with ThreadPoolExecutor(max_workers=max(1, parallel)) as workers:
            outcomes += list(workers.map(lambda context, case: context.run(run_io, case), contexts, cases))
    return CodeReport(passed=sum(ok for ok, _ in outcomes), total=len(outcomes), details=[d for _, d in outcomes],
                       suspicious=sorted(suspicious))
