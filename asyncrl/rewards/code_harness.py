"""The test harness that runs inside the sandbox, next to the candidate program (standard library
only: it is copied into the sandbox as `harness.py` and run by the sandbox's interpreter).

It is the program's main: it loads `solution.py` (the candidate) as `__main__`, then evaluates
each test of `tests.json` and reports through its own channel, a copy of the original stdout,
every record prefixed with a nonce read from stdin before any candidate code ran. The candidate's
own stdout goes to /dev/null, so nothing it prints is a record.

What the candidate cannot forge, and why:
* **Expected values never enter this process.** An assertion that an expression equals a literal
  arrives here as the expression alone; its value is serialised and the verifier compares it with
  the literal outside. To be counted right, a value must be right. (No example here: the candidate
  can read this file, and a worked example is an answer to look up.)
* **Values are plain.** Only exact built-in types serialise (no subclass, no object with its own
  `__eq__`), and every operand of a comparison or arithmetic inside a test is checked the same way
  (`__plain__`), so an object that claims to equal anything fails where it is used.
* **Tests see pristine builtins**, snapshotted before the candidate ran (patching `builtins.abs`
  changes nothing for the tests), and are compiled here with assertions kept (`python -O` tricks
  reach nothing).
* **A test passes only when this harness reported it.** An early exit, a hook on exceptions or on
  exit, or a re-exec leaves the rest unreported, so unpassed.

Assertions whose expected value is not a literal (and test programs) report completion instead of
a value; that record's only protection is the nonce, which lives in this process's memory.
"""

import ast
import builtins
import json
import os
import signal

_type, _len, _repr, _str, _isinstance = type, len, repr, str, isinstance
_write, _dup, _dup2, _open, _close = os.write, os.dup, os.dup2, os.open, os.close
_dumps = json.dumps
MAX_NODES = 100_000


class NotPlain(Exception):
    """A test compared or returned something that is not a plain value."""


class TestTimeout(BaseException):
    """A test ran past its time (raised by SIGALRM)."""


def encode(value, budget=None):
    """A plain value as tagged JSON-able data; raises NotPlain for anything else (subclasses too)."""
    budget = budget if budget is not None else [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise NotPlain("value too large to compare")
    t = _type(value)
    if t is type(None):
        return None
    if t is bool:
        return value
    if t is int:
        try:
            return {"i": _str(value)}
        except ValueError:
            raise NotPlain("integer too large to compare") from None
    if t is float:
        return {"f": _repr(value)}
    if t is complex:
        return {"c": [_repr(value.real), _repr(value.imag)]}
    if t is str:
        return {"s": value}
    if t is bytes:
        return {"y": value.hex()}
    if t is list or t is tuple or t is set or t is frozenset:
        tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}[t]
        return {tag: [encode(v, budget) for v in value]}
    if t is dict:
        return {"d": [[encode(k, budget), encode(v, budget)] for k, v in value.items()]}
    raise NotPlain("a %s, not a plain value" % t.__name__)


def plain(value):
    """`__plain__` inside tests: the value itself when it is plain, else NotPlain."""
    encode(value)
    return value


class _CheckOperands(ast.NodeTransformer):
    """Wraps every non-constant operand of a comparison, arithmetic or `not` in `__plain__(...)`."""

    def _wrap(self, node):
        if _isinstance(node, ast.Constant):
            return node
        return ast.Call(func=ast.Name(id="__plain__", ctx=ast.Load()), args=[node], keywords=[])

    def visit_Compare(self, node):
        self.generic_visit(node)
        node.left = self._wrap(node.left)
        node.comparators = [self._wrap(c) for c in node.comparators]
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        node.left, node.right = self._wrap(node.left), self._wrap(node.right)
        return node

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        node.operand = self._wrap(node.operand)
        return node

    def visit_Assert(self, node):
        self.generic_visit(node)
        node.test = self._wrap(node.test)
        return node


def compile_test(kind, source):
    tree = ast.parse(source, mode="eval" if kind == "value" else "exec")
    tree = ast.fix_missing_locations(_CheckOperands().visit(tree))
    return compile(tree, "<test>", "eval" if kind == "value" else "exec", optimize=0, dont_inherit=True)


def _describe(exc):
    text = "%s: %s" % (_type(exc).__name__, exc)
    return text[:300]


def _alarm(signum, frame):
    raise TestTimeout()


def _report_channel():
    """The nonce from stdin, and a `report(*fields)` writing nonce-led lines to the original stdout,
    taken before the candidate runs (stdout and stdin then point at /dev/null: what it prints is
    not a record)."""
    nonce = b""
    while not nonce.endswith(b"\n"):
        chunk = os.read(0, 64)
        if not chunk:
            break
        nonce += chunk
    nonce = nonce.strip()
    report_fd = _dup(1)
    devnull = _open(os.devnull, os.O_RDWR)
    _dup2(devnull, 0)
    _dup2(devnull, 1)
    _close(devnull)

    def report(*fields):
        line = b" ".join([nonce, *[f if _isinstance(f, bytes) else _str(f).encode() for f in fields]]) + b"\n"
        _write(report_fd, line)

    return report


def _compiled_tests(job):
    compiled = []
    for test in job["tests"]:
        try:
            compiled.append(compile_test(test["kind"], test["source"]))
        except SyntaxError as exc:
            compiled.append(exc)
    return compiled


def _test_runner(report):
    """`run_one(index, code, kind, namespace, per_test_s)`: one test in a fresh copy of the namespace,
    its time bounded by the alarm. Made before the candidate runs, with every name it calls taken
    then: a candidate that rebinds the harness module's names (`encode`, `json.dumps`, ...) changes
    nothing it uses."""
    encode_value, dumps, describe, setitimer, real = encode, _dumps, _describe, signal.setitimer, signal.ITIMER_REAL
    timeout, not_plain, run_eval, run_exec, as_text = TestTimeout, NotPlain, eval, exec, _str

    def run_one(index, code, kind, namespace, per_test_s):
        if per_test_s:
            setitimer(real, per_test_s)
        try:
            if kind == "value":
                value = encode_value(run_eval(code, dict(namespace)))
                setitimer(real, 0)
                report(index, "value", dumps(value))
            else:
                run_exec(code, dict(namespace))
                setitimer(real, 0)
                report(index, "completed")
        except timeout:
            report(index, "timeout")
        except SystemExit as exc:
            setitimer(real, 0)
            report(index, "exit", dumps(as_text(exc.code)))
        except not_plain as exc:
            setitimer(real, 0)
            report(index, "not_plain", dumps(as_text(exc)))
        except BaseException as exc:
            setitimer(real, 0)
            report(index, "error", dumps(describe(exc)))

    return run_one


def main():
    report = _report_channel()
    job = json.load(open("tests.json"))
    per_test_s = float(job.get("per_test_s", 0)) or None
    compiled = _compiled_tests(job)
    pristine = dict(builtins.__dict__)
    source = open("solution.py", encoding="utf-8", errors="replace").read()
    try:
        defined = {n.name for n in ast.parse(source).body if _isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    except SyntaxError:
        defined = set()
    candidate = {"__name__": "__main__", "__builtins__": builtins, "__file__": "solution.py"}
    run_one, plain_check = _test_runner(report), plain  # before the candidate runs (see `_test_runner`)
    try:
        exec(compile(source, "solution.py", "exec", dont_inherit=True), candidate)
    except SystemExit as exc:
        report("load_exit", _dumps(_str(exc.code)))
        return
    except BaseException as exc:  # the candidate's own errors: every test fails with this reason
        report("load_error", _dumps(_describe(exc)))
        return
    report("loaded")
    # The tests' namespace: the candidate's names, but builtins as they were before it ran, unless
    # the candidate defined a function or class of that name itself (the test is about it).
    namespace = {k: v for k, v in candidate.items() if k not in pristine or k in defined}
    namespace["__builtins__"] = pristine
    namespace["__plain__"] = plain_check
    signal.signal(signal.SIGALRM, _alarm)
    for index, code in enumerate(compiled):
        if _isinstance(code, SyntaxError):
            report(index, "error", _dumps("the test does not parse: %s" % code))
            continue
        run_one(index, code, job["tests"][index]["kind"], namespace, per_test_s)
    report("done")


if __name__ == "__main__":
    main()
