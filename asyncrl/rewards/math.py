"""Math answer checking with `math-verify`: extraction (\\boxed{}, "Answer:" lines, plain
expressions) and symbolic equivalence to the ground truth."""

from __future__ import annotations

import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# Only the tail of a response is searched (DAPO's verifier keeps the last 300 characters), so an
# answer mentioned early and abandoned does not count, and huge responses cost nothing extra.
TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
_BOXED = re.compile(r"\\boxed\s*\{")

_EXTRACTION = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only works on the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


def extract_answer(response: str) -> str | None:
    """The candidate answer text: the last \\boxed{...}, else the last "Answer:" line, else the tail."""
    tail = response[-TAIL_CHARS:]
    boxes = list(_BOXED.finditer(tail))
    if boxes:
        start = boxes[-1].start()
        depth, i = 0, boxes[-1].end() - 1
        while i < len(tail):
            depth += {"{": 1, "}": -1}.get(tail[i], 0)
            if depth == 0:
                return tail[start : i + 1]
            i += 1
        return None  # unclosed box
    lines = _ANSWER_LINE.findall(tail)
    if lines:
        return lines[-1].strip()
    return None


def math_correct(response: str, ground_truth: str, require_boxed: bool = False) -> tuple[bool, str]:
    """Is the response's final answer equivalent to `ground_truth`? Returns (correct, prediction).

    `require_boxed=True` accepts only a \\boxed{} answer (format-strict tasks); otherwise an
    "Answer:" line or, failing both, the last expression of the response's tail is used.
    """
    candidate = extract_answer(response)
    if candidate is None:
        if require_boxed:
            return False, ""
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?", response[-TAIL_CHARS:])
        if not numbers:
            return False, ""
        candidate = numbers[-1]
    elif require_boxed and not candidate.startswith("\\boxed"):
        return False, candidate
    timeout = _timeout()
    pred = parse(candidate if candidate.startswith("\\boxed") else f"${candidate}$",
                 extraction_config=_EXTRACTION, parsing_timeout=timeout, extraction_mode="first_match")
    if not pred:
        pred = parse(candidate, extraction_config=_EXTRACTION, parsing_timeout=timeout, extraction_mode="first_match")
    if not pred:
        return False, candidate
    gold = parse(f"${ground_truth}$", extraction_config=_EXTRACTION, parsing_timeout=timeout)
    if not gold:
        gold = [ground_truth]
    return bool(verify(gold, pred, timeout_seconds=timeout)), str(pred[-1])


def score_from_correct(correct: bool, style: str) -> float:
    """zero_one: 1/0; plus_minus: +1/-1 (DAPO)."""
    if style == "zero_one":
        return 1.0 if correct else 0.0
    if style == "plus_minus":
        return 1.0 if correct else -1.0
    raise ValueError(f"unknown reward style {style!r}")
