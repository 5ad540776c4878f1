"""Math answer checking with `math-verify`: extraction (\\boxed{}, "Answer:" lines, plain
expressions) and symbolic equivalence to the ground truth.

Symbolic checking can run away: `\\boxed{9^{9^{9}}}` or `\\boxed{(10^{8})!}` asks sympy for numbers
with millions of digits, and math-verify's own timeouts (SIGALRM) work only on a main thread, not
in the reward endpoint's worker threads. So `math_correct`, the public check, runs the comparison
(`_math_correct_unguarded`) in two worker processes (a `pebble` process pool): there it runs on the
worker's main thread with math-verify's timeouts on, under an address-space limit, and a check that
still overruns its wall-clock budget is killed with its worker and answered as a failure with the
reason. The unguarded comparison is private: called from a thread on a power tower it holds the
GIL for minutes. A reward call that stops (`asyncrl.rewards.calls`) kills the check it waits for.
"""

from __future__ import annotations

import atexit
import multiprocessing
import re
import resource
import threading
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import TimeoutError as FutureTimeout

import pebble
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from asyncrl.rewards.calls import CallStopped, current_call

# Only the tail of a response is searched (DAPO's verifier keeps the last 300 characters), so an
# answer mentioned early and abandoned does not count, and huge responses cost nothing extra.
TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
_BOXED = re.compile(r"\\boxed\s*\{")

_EXTRACTION = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


# Worst case per response: the workers' hard limit. math-verify's own limits (parse and compare, each
# SIGALRM-based) end most runaways earlier, inside it.
MATH_TIMEOUT_S = 6.0
MATH_WORKER_MEMORY_MB = 1024
MAX_GROUND_TRUTH_CHARS = 1000  # longer references are compared as text, never parsed
_INNER_TIMEOUT_S = 2


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only works on the main thread.
    return _INNER_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


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


def _math_correct_unguarded(response: str, ground_truth: str, require_boxed: bool = False) -> tuple[bool, str]:
    """`math_correct`'s comparison, (correct, prediction), unbounded in time and memory off the
    main thread: run only in `math_correct`'s worker processes."""
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


def _limit_worker_memory(memory_mb: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))


_WORKERS: pebble.ProcessPool | None = None
_WORKERS_LOCK = threading.Lock()


def _workers() -> pebble.ProcessPool:
    global _WORKERS
    with _WORKERS_LOCK:
        if _WORKERS is None or not _WORKERS.active:
            # spawn: the callers (Ray actors, the learner) hold threads and torch state a fork would copy.
            _WORKERS = pebble.ProcessPool(max_workers=2, max_tasks=2000, initializer=_limit_worker_memory,
                                          initargs=(MATH_WORKER_MEMORY_MB,),
                                          context=multiprocessing.get_context("spawn"))
            atexit.register(_WORKERS.stop)
        return _WORKERS


def math_correct(response: str, ground_truth: str, require_boxed: bool = False,
                 timeout_s: float = MATH_TIMEOUT_S) -> tuple[bool, str, str]:
    """Is the response's final answer equivalent to `ground_truth`? (correct, prediction, problem),
    where problem is "" or why the check gave up (the answer then counts as wrong). Bounded: at
    most `timeout_s` of a worker process's time and `MATH_WORKER_MEMORY_MB` of memory, from any thread.

    `require_boxed=True` accepts only a \\boxed{} answer (format-strict tasks); otherwise an
    "Answer:" line or, failing both, the last expression of the response's tail is used."""
    if len(ground_truth) > MAX_GROUND_TRUTH_CHARS:
        candidate = extract_answer(response) or ""
        inner = candidate[len("\\boxed{"):-1] if candidate.startswith("\\boxed{") else candidate
        return inner.strip() == ground_truth.strip(), inner[:200], "ground truth too long to parse: compared as text"
    future = _workers().schedule(_math_correct_unguarded, args=(response, ground_truth, require_boxed),
                                 timeout=timeout_s)
    call = current_call()
    forget = call.on_stop(future.cancel)  # a stopped call: pebble kills the worker running the check
    try:
        correct, pred = future.result()
        return correct, pred, ""
    except FutureCancelled:
        raise CallStopped(call.reason) from None
    except FutureTimeout:
        return False, "", f"math check ran past {timeout_s:g} s (killed)"
    except pebble.ProcessExpired as exc:
        return False, "", f"math check died ({exc}; memory limit {MATH_WORKER_MEMORY_MB} MB)"
    finally:
        forget()
