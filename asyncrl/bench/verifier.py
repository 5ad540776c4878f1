"""The verifier under attack and under load: every hostile candidate of `asyncrl.bench.hostile`
through the verifier's entry point (what it earned and why), the worst-case math probes, and
throughput (programs checked per second, math answers per second) on this machine.

    asyncrl bench verifier [--quick]
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from asyncrl.bench.hostile import HOSTILE_CODE
from asyncrl.rewards.sandbox import probe_isolation
from asyncrl.rewards.verifiers import verify

ASSERTS = json.dumps({"asserts": [f"assert add({i}, {i + 1}) == {2 * i + 1}" for i in range(4)]})
IO = json.dumps({"inputs": [f"{i} {i + 1}\n" for i in range(4)], "outputs": [str(2 * i + 1) for i in range(4)]})
PROGRAMS = {
    "asserts (4 per program)": ("```python\ndef add(a, b):\n    return a + b\n```", ASSERTS),
    "stdin/stdout (4 cases)": ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", IO),
}
MATH_PROBES = [("\\boxed{9^{9^{9}}}", "3"), ("\\boxed{(10^{8})!}", "3"), ("\\boxed{3}", "1" * 1_000_000)]


def throughput(kind: str, response: str, truth: str, programs: int, threads: int) -> float:
    """Programs (or answers) verified per second, `threads` at a time as the endpoint's threads do."""
    verify(kind, response, truth)  # warm: probes, worker processes
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as workers:
        results = list(workers.map(lambda _: verify(kind, response, truth), range(programs)))
    assert all(r.correct for r in results), results[0].details
    return programs / (time.perf_counter() - start)


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    hostile = []
    for c in HOSTILE_CODE:
        start = time.perf_counter()
        v = verify("code", c.response(), c.tests)
        hostile.append({"name": c.name, "family": c.family, "honest": c.honest, "passed": v.details.get("passed"),
                        "tests": v.details.get("tests"), "suspicious": v.suspicious,
                        "reason": (v.details.get("failures") or ["-"])[0], "seconds": time.perf_counter() - start})
    math = []
    for response, truth in MATH_PROBES:
        start = time.perf_counter()
        v = verify("math", response, truth)
        math.append({"response": response, "truth_chars": len(truth), "correct": v.correct,
                     "problem": v.details.get("problem", ""), "seconds": time.perf_counter() - start})
    n = 8 if quick else 40
    rates = {name: {t: throughput("code", r, truth, n, t) for t in (1, 2)} for name, (r, truth) in PROGRAMS.items()}
    rates["math answers"] = {t: throughput("math", "so \\boxed{\\frac{1}{2}}", "0.5", 5 * n, t) for t in (1, 2)}
    return {"isolation": probe_isolation(), "hostile": hostile, "math_probes": math, "per_second": rates}


def report(result: dict) -> str:
    lines = [f"isolation: {result['isolation']}", "", "| candidate | family | passed | suspicious | reason |",
             "|---|---|---|---|---|"]
    for h in result["hostile"]:
        lines.append(f"| {h['name']} | {h['family']} | {h['passed']}/{h['tests']} | {', '.join(h['suspicious']) or '-'} "
                     f"| {h['reason'][:70]} |")
    lines += ["", "| math probe | correct | seconds | note |", "|---|---|---|---|"]
    for m in result["math_probes"]:
        lines.append(f"| `{m['response'][:24]}` (truth {m['truth_chars']} chars) | {m['correct']} | {m['seconds']:.2f} "
                     f"| {m['problem'] or '-'} |")
    lines += ["", "| workload | 1 thread /s | 2 threads /s |", "|---|---|---|"]
    for name, r in result["per_second"].items():
        lines.append(f"| {name} | {r[1]:.1f} | {r[2]:.1f} |")
    return "\n".join(lines)
