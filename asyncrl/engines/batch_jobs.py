"""A request's rows and steps as the policy endpoint's batcher (`asyncrl.engines.batching`) holds
them: a job (its rows, settings and queue of steps), each row, each token as its job reads it
(`StepToken`), and the job's side of the stream (`JobSteps`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.messages.structs import FinishReason

class TooLarge(ValueError):
    """A job whose rows could never fit in one window's bounds."""


@dataclass(frozen=True)
class StepToken:
    """One token of one row of a job: `finish` is EOS or MAX_LENGTH on its row's last token (None
    while it goes on); `top`: None, or `(ids, logprobs)` of that position's most likely tokens."""

    row: int
    token: int
    logprob: float
    finish: FinishReason | None
    top: tuple[list[int], list[float]] | None
    version: int


@dataclass(eq=False)
class BatchRow:
    job: "BatchJob"
    index: int
    sequence: SequenceInput
    response: list[int] = field(default_factory=list)
    done: bool = False


@dataclass(eq=False)
class BatchJob:
    params: SamplingParams
    queue: asyncio.Queue
    rows: list[BatchRow] = field(default_factory=list)
    live: bool = True
    closed: bool = False
    started: bool = False
    ended: bool = False  # its stream's end is queued
    held: list[StepToken] = field(default_factory=list)  # a whole answer's steps of the window running

    def live_rows(self) -> list[BatchRow]:
        return [] if self.closed else [r for r in self.rows if not r.done]


class JobSteps:
    """A job's steps (async iterator of `list[StepToken]`), ending when every row has ended or was
    dropped. `drop(rows)`: stop generating those rows (a stop string or a tool call found);
    `close()`: the caller is gone, every row is freed at the next window boundary."""

    def __init__(self, batcher: Any, job: BatchJob):  # its `WindowBatcher`
        self.batcher, self.job = batcher, job

    def __aiter__(self) -> "JobSteps":
        return self

    async def __anext__(self) -> list[StepToken]:
        job = self.job
        while job.live_rows() or not job.queue.empty():
            steps = await job.queue.get()
            if steps is None:
                break
            if isinstance(steps, BaseException):
                raise steps
            return steps + drain(job.queue)
        raise StopAsyncIteration

    def drop(self, rows: list[int]) -> None:
        for i in rows:
            self.job.rows[i].done = True

    def close(self) -> None:
        if self.job.live_rows():
            self.batcher.counters["jobs_left"] += 1
        self.job.closed = True
        self.batcher._wake.set()


def step_token(row: BatchRow, token: int, logprob: float, reason: FinishReason | None, top, version: int) -> StepToken:
    """One token of a row as its job sees it, whether read per decode step or from a window's
    outputs: a finish only where the row ends (a window's end is not one), the most likely tokens
    cut to the job's `top_logprobs` (none when it asks for none)."""
    k = row.job.params.top_logprobs
    finish = None if reason is FinishReason.WINDOW else reason
    return StepToken(row.index, token, logprob, finish, (top[0][:k], top[1][:k]) if k and top is not None else None,
                     version)


def drain(queue: asyncio.Queue) -> list[StepToken]:
    """The steps already waiting behind the one taken (a consumer that fell behind reads them in
    one go), up to the first item that is not steps (an end or an error), which stays queued."""
    steps = []
    while not queue.empty() and isinstance(queue._queue[0], list):  # noqa: SLF001 - peek, asyncio has no API
        steps += queue.get_nowait()
    return steps


def ids_of(tokens: list[int]):
    import numpy as np

    return np.asarray(tokens, dtype=np.int32)
