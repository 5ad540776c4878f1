"""A policy-endpoint job on an inference server's engine (`server_engine.ServerEngine`: SGLang,
vLLM): each row (sequence) one streamed request in a task of its own, its tokens handed on as
`StepToken`s as they come, through one queue per job.

* A request that a weight update cuts continues from its tokens so far under the new weights, as
  a generator's window does (the subclass's `_generate`).
* Dropping a row, or closing the whole stream (the client gone), cancels its task: the server
  aborts a request whose stream is closed, so its KV goes back to the server's pool at once.
"""

from __future__ import annotations

import asyncio

from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.engines.batch_jobs import StepToken, drain


class RequestSteps:
    """The steps of one job of sequences (the interface of `asyncrl.engines.batch_jobs.JobSteps`);
    a subclass's `_generate(i, seq)` streams row `i` into `self.queue` as lists of `StepToken`."""

    def __init__(self, engine, sequences: list[SequenceInput], params: SamplingParams):
        self.engine, self.params = engine, params
        self.queue: asyncio.Queue = asyncio.Queue()
        self.live = set(range(len(sequences)))
        self.tasks = {i: asyncio.ensure_future(self._row(i, s)) for i, s in enumerate(sequences)}

    def __aiter__(self) -> "RequestSteps":
        return self

    async def __anext__(self) -> list[StepToken]:
        while self.live or not self.queue.empty():
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is not None:  # None: a row ended
                return item + drain(self.queue)
        raise StopAsyncIteration

    def drop(self, rows: list[int]) -> None:
        for i in rows:
            if i in self.live:
                self.tasks[i].cancel()

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    async def _row(self, i: int, seq: SequenceInput) -> None:
        try:
            await self._generate(i, seq)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - the job fails with it, read by its consumer
            self.queue.put_nowait(exc)
        finally:
            self.live.discard(i)
            self.queue.put_nowait(None)

    async def _generate(self, i: int, seq: SequenceInput) -> None:
        raise NotImplementedError
