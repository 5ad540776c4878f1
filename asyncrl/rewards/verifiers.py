"""Rule-based reasoning-task verifiers (RTV): math answers, code against unit tests, format checks,
and the built-in tiny tasks. One entry point, `verify(kind, ...)`, returning a `Check`.

A verifier is pure with respect to its inputs (the code verifier runs a sandboxed subprocess), so
an endpoint can call it from any thread; every failure mode becomes a failing check with a reason.
"""

from __future__ import annotations

import typing
import zlib
from dataclasses import dataclass, field

from asyncrl.config.reward import VerifierKind
from asyncrl.messages.structs import ground_truth_text
from asyncrl.rewards.math import MATH_TIMEOUT_S, math_correct, score_from_correct

# The kinds `verify` checks (`none`: no rule applies, a hybrid route falls through to a judge).
VERIFIER_KINDS = tuple(kind for kind in typing.get_args(VerifierKind) if kind != "none")
EPISODE_TRUTH = "episode"  # a task's ground truth where each episode has its own answer (the lookup tool's)
MAX_RESPONSE_CHARS = 256 << 10  # longer responses are judged on their tail / rejected for code


@dataclass
class Check:
    score: float
    correct: bool
    details: dict = field(default_factory=dict)
    suspicious: list[str] = field(default_factory=list)  # reward-hacking conduct seen (code: early_exit, ...)


def episode_truth(ground_truth: str, prompt_id: str, sample_idx: int) -> str:
    """The answer a sample is checked against: its episode's own where the task says so."""
    return episode_secret(prompt_id, sample_idx) if ground_truth == EPISODE_TRUTH else ground_truth


def episode_secret(prompt_id: str, sample_idx: int) -> str:
    """The tiny tool task's answer of one episode: a digit drawn from its identity (the verifier and
    the lookup tool compute the same; a regenerated episode keeps it)."""
    return str(zlib.crc32(f"{prompt_id}/{sample_idx}".encode()) % 10)


def kind_for(data_source: str) -> str:
    """Default verifier for a dataset name (verl's `data_source`)."""
    name = data_source.lower()
    if name in ("tiny", "tiny_seq", "tiny_tool"):
        return name
    if name == "shapes":  # the built-in image task: its answer is the first character, as tiny's
        return "tiny"
    if any(key in name for key in ("code", "apps", "mbpp", "humaneval", "livecodebench", "taco", "primeintellect")):
        return "code"
    return "math"


def format_check(response: str, min_chars: int = 1, max_chars: int = 8192, require_boxed: bool = True) -> Check:
    """Format check: an answer is present (a \\boxed{} or an "Answer:" line) and the length is sane."""
    from asyncrl.rewards.math import extract_answer

    answer = extract_answer(response)
    problems = []
    if len(response.strip()) < min_chars:
        problems.append("empty")
    if len(response) > max_chars:
        problems.append(f"longer than {max_chars} characters")
    if answer is None or (require_boxed and not answer.startswith("\\boxed")):
        problems.append("no final answer")
    ok = not problems
    return Check(1.0 if ok else 0.0, ok, {"format_problems": problems})


def verify(kind: str, response: str, ground_truth, style: str = "zero_one", code_limits=None,
           math_timeout_s: float = MATH_TIMEOUT_S) -> Check:
    """Score one response. `style`: zero_one (1/0) or plus_minus (+1/-1, DAPO); the code verifier
    scores all-pass and reports the per-test pass fraction. `ground_truth`: text (a number is read
    as written); the code verifier also takes its tests as a dict."""
    if kind == "code" and isinstance(ground_truth, (dict, list)):
        ground_truth = ground_truth_text(ground_truth)  # the tests, as `parse_tests` reads them
    elif not isinstance(ground_truth, (str, int, float)) or isinstance(ground_truth, bool):
        raise ValueError(f"the {kind} verifier checks against text, not a {type(ground_truth).__name__}: "
                         f"score such data with a reward function of your own (kind: python)")
    ground_truth = ground_truth_text(ground_truth)
    if kind in ("tiny", "tiny_tool"):  # the first character (of an episode's final turn)
        pred = response[:1]
        return Check(score_from_correct(pred == ground_truth, style), pred == ground_truth, {"pred": pred})
    if kind == "tiny_seq":
        pred = response[: len(ground_truth)]
        hits = sum(a == b for a, b in zip(pred, ground_truth))
        credit = hits / len(ground_truth)
        return Check(credit if style == "zero_one" else 2 * credit - 1, hits == len(ground_truth), {"pred": pred})
    if kind == "math":
        correct, pred, problem = math_correct(response[-MAX_RESPONSE_CHARS:], ground_truth, timeout_s=math_timeout_s)
        details = {"pred": pred[:200], **({"problem": problem} if problem else {})}
        return Check(score_from_correct(correct, style), correct, details)
    if kind == "code":
        from asyncrl.rewards.code import extract_code, parse_tests, run_tests
        from asyncrl.rewards.sandbox import SandboxLimits

        if len(response) > MAX_RESPONSE_CHARS:
            return Check(score_from_correct(False, style), False, {"error": "response too long to run"})
        tests = parse_tests(ground_truth)
        report = run_tests(extract_code(response), tests, code_limits or SandboxLimits())
        return Check(score_from_correct(report.all_passed, style), report.all_passed,
                     {"pass_fraction": report.pass_fraction, "passed": report.passed, "tests": report.total,
                      "failures": [d for d in report.details if d != "ok"][:5]}, suspicious=report.suspicious)
    if kind == "format":
        check = format_check(response)
        return Check(score_from_correct(check.correct, style), check.correct, check.details)
    raise ValueError(f"unknown verifier kind {kind!r}; expected one of {VERIFIER_KINDS}")
