"""A reward function of the user's (`kind: python`), in a file or a module, as verl and TRL call theirs:

* verl, per sample: `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw)`
  returning a number, or a dict with `score` and other numbers (averaged per data source into the
  step records, as verl logs them). verl's own scorers (`gsm8k.compute_score(solution_str,
  ground_truth)`) work too: each is called with the arguments it names.
* TRL, per batch: `fn(prompts, completions, **columns) -> list[float | None]`; `None` means "not
  applicable" (a hybrid route falls through to its next endpoint).

Calls run in worker processes (a `pebble` process pool, spawned: the endpoint holds threads a fork would
copy; what they run is `asyncrl.rewards.user_worker`, light to import), each with a timeout: a call
that hangs is killed with its worker, not waited for, and a CPU-bound scorer does not stall the
endpoint's event loop. A call that stops (its caller cancels it, or its deadline passes at the
endpoint: `asyncrl.rewards.calls`) kills the workers on its samples and drops those not begun; the
samples already scored keep their rewards. Each worker has `worker_memory_mb` of address space (a
call past it fails as out of memory, its worker replaced) and is replaced after `worker_max_calls`
calls. `async def` functions are run to completion in the worker. Whatever goes wrong (an exception,
a timeout, a value that is not a finite number, a list of the wrong length, a worker that died) is a
failed reward with the reason, never a lost sample.
"""

from __future__ import annotations

import atexit
import inspect
import math
import multiprocessing
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import pebble

from asyncrl.config import PythonRewardEndpoint
from asyncrl.messages.structs import Reward, RewardRequest
from asyncrl.rewards.calls import current_call
from asyncrl.rewards.user_worker import OUT_OF_MEMORY_EXIT, call_trl, call_verl, load_function, load_in_worker
from asyncrl.rewards.verifier import failed, not_applicable

VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


def detect_signature(function: Callable, asked: str) -> str:
    """verl | trl: what `asked` says, or (auto) what the parameter names say."""
    if asked != "auto":
        return asked
    names = set(inspect.signature(function).parameters)
    if "completions" in names:
        return "trl"
    if "solution_str" in names:
        return "verl"
    raise ValueError(f"cannot tell the signature of {function.__name__}({', '.join(names)}): verl's takes "
                     f"solution_str (and data_source, ground_truth, extra_info), TRL's takes completions; set "
                     f"signature: verl or trl")


def finite(value) -> float | None:
    """A score as a float, or None when it is not a finite number (a bool counts as 0/1; numpy's and
    torch's scalars arrive as Python numbers, `user_worker.plain`)."""
    if isinstance(value, (int, float)) and math.isfinite(float(value)):
        return float(value)
    return None


class PythonReward:
    """The scorer of a `kind: python` endpoint (`RewardEndpoint` calls `score` from a thread)."""

    name = "python"

    def __init__(self, endpoint: PythonRewardEndpoint):
        self.endpoint = endpoint
        function = load_function(endpoint.path, endpoint.function)  # fails at start-up, naming why
        self.signature = detect_signature(function, endpoint.signature)
        print(f"reward endpoint (python): {endpoint.path}:{endpoint.function} called with "
              f"{self.signature}'s signature", flush=True)
        self.workers = pebble.ProcessPool(max_workers=endpoint.workers, max_tasks=endpoint.worker_max_calls,
                                          initializer=load_in_worker,
                                          initargs=(endpoint.path, endpoint.function, endpoint.worker_memory_mb),
                                          context=multiprocessing.get_context("spawn"))
        atexit.register(self.workers.stop)
        self.counters = {"calls": 0, "failed": 0, "timed_out": 0, "not_applicable": 0, "samples_cancelled": 0,
                         "out_of_memory": 0, "workers_died": 0}

    @property
    def version(self) -> str:
        return self.endpoint.version

    def reconfigure(self, endpoint: PythonRewardEndpoint) -> bool:
        """Another file, function, worker count or version is a new scorer (the file is read again)."""
        return endpoint == self.endpoint

    def close(self) -> None:
        self.workers.stop()

    def score(self, requests: list[RewardRequest]) -> list[Reward]:
        if self.signature == "trl":
            return self._score_batch(requests)
        futures = [self.workers.schedule(call_verl, args=(verl_arguments(r),), timeout=self.endpoint.call_timeout_s)
                   for r in requests]
        self._cancel_with_call(futures)
        return [self._reward(r, f) for r, f in zip(requests, futures)]

    def _cancel_with_call(self, futures: list) -> None:
        """A stopped call (cancelled, or past its deadline) cancels its futures not done: pebble
        kills the workers running them (a new one starts in each place) and never starts the others;
        those done keep their results."""
        def cancel():
            cancelled = sum(future.cancel() for future in futures)
            self.counters["samples_cancelled"] += cancelled

        current_call().on_stop(cancel)

    def _reward(self, request: RewardRequest, future) -> Reward:
        self.counters["calls"] += 1
        try:
            value = future.result()
        except Exception as exc:  # noqa: BLE001 - the user's code failing is a failed reward, with why
            return self._failed(request, exc)
        score, extra = (value.get("score"), value) if isinstance(value, dict) else (value, {})
        if finite(score) is None:
            return self._failed(request, f"{self.endpoint.function} returned {value!r:.200}, not a finite number")
        numbers = {k: float(v) for k, v in extra.items() if k != "score" and finite(v) is not None}
        correct = bool(extra["acc"]) if isinstance(extra.get("acc"), (bool, int, float)) else None
        return Reward(prompt_id=request.prompt_id, sample_idx=request.sample_idx, score=float(score), correct=correct,
                      source=self.name, source_version=self.version, details={"extra": numbers} if numbers else {})

    def _score_batch(self, requests: list[RewardRequest]) -> list[Reward]:
        prompts, completions, columns = trl_arguments(requests)
        future = self.workers.schedule(call_trl, args=(prompts, completions, columns),
                                       timeout=self.endpoint.call_timeout_s)
        self._cancel_with_call([future])
        self.counters["calls"] += 1
        try:
            values = future.result()
        except Exception as exc:  # noqa: BLE001
            return [self._failed(r, exc) for r in requests]
        if not isinstance(values, (list, tuple)) or len(values) != len(requests):
            shown = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(values)[:100]
            return [self._failed(r, f"{self.endpoint.function} returned {shown} for {len(requests)} completions")
                    for r in requests]
        out = []
        for request, value in zip(requests, values):
            if value is None:
                self.counters["not_applicable"] += 1
                out.append(not_applicable(request, self.name, self.version, f"{self.endpoint.function} returned None"))
            elif finite(value) is None:
                out.append(self._failed(request, f"{self.endpoint.function} returned {value!r:.200}, not a finite number"))
            else:
                out.append(Reward(prompt_id=request.prompt_id, sample_idx=request.sample_idx, score=float(value),
                                  source=self.name, source_version=self.version))
        return out

    def _failed(self, request: RewardRequest, why) -> Reward:
        self.counters["failed"] += 1
        function = self.endpoint.function
        if isinstance(why, FutureTimeout):
            self.counters["timed_out"] += 1
            why = f"{function} ran past {self.endpoint.call_timeout_s:g} s (killed)"
        elif isinstance(why, FutureCancelled):
            why = f"{function} was stopped: {current_call().reason or 'the call stopped'}"
        elif isinstance(why, pebble.ProcessExpired) and why.exitcode == OUT_OF_MEMORY_EXIT:
            self.counters["out_of_memory"] += 1
            why = (f"{function} ran out of memory: it asked for more than worker_memory_mb="
                   f"{self.endpoint.worker_memory_mb} MiB of address space (its worker was replaced)")
        elif isinstance(why, pebble.ProcessExpired):  # killed from outside, or a library aborted
            self.counters["workers_died"] += 1
            why = (f"the worker running {function} died (exit status {why.exitcode}; worker_memory_mb="
                   f"{self.endpoint.worker_memory_mb}): a new one took its place")
        elif isinstance(why, BaseException):  # what a user's traceback would say first, and where
            why = f"{type(why).__name__}: {why} in {function} ({self.endpoint.path})"
        return failed(request, self.name, self.version, why)

    def stats(self) -> dict:
        return {**self.counters, "signature": self.signature, "version": self.version}


def verl_arguments(request: RewardRequest) -> dict:
    """verl's arguments for one sample: `extra_info` is the row's, with the sample's identity."""
    row = request.row or {}
    extra = dict(row.get("extra_info") or {}) if isinstance(row.get("extra_info"), dict) else {}
    extra.update(prompt_id=request.prompt_id, sample_index=request.sample_idx)
    return {"data_source": request.data_source, "solution_str": request.response_text,
            "ground_truth": request.ground_truth, "extra_info": extra}


def trl_arguments(requests: list[RewardRequest]) -> tuple[list, list, dict]:
    """TRL's arguments for a batch: the prompts as the data wrote them (text, or chat messages, then
    each completion is an assistant message as TRL gives it), and every other column of the rows,
    one list each, with `ground_truth` and `data_source`."""
    rows = [r.row or {} for r in requests]
    prompts = [row.get("prompt", r.prompt_text) for row, r in zip(rows, requests)]
    completions = [[{"role": "assistant", "content": r.response_text}] if isinstance(p, list) else r.response_text
                   for p, r in zip(prompts, requests)]
    keys = sorted({k for row in rows for k in row} - {"prompt"})
    columns = {k: [row.get(k) for row in rows] for k in keys}
    columns.update(ground_truth=[r.ground_truth for r in requests], data_source=[r.data_source for r in requests],
                   prompt_ids=[r.prompt_id for r in requests], sample_indices=[r.sample_idx for r in requests])
    return prompts, completions, columns
