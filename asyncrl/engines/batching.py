"""Continuous batching of independent requests on the embedded engine (the policy endpoint).

Requests arrive one by one over HTTP; each is a job of rows (its prompts x n choices). One loop
runs engine windows of `window_tokens` over the rows of every job in flight: a window is one
engine call, so 16 concurrent clients cost about one client's decode steps, not 16 times as
many. Between two windows the loop drops the rows that ended (EOS, length, a stop string or a
tool call found by the caller, a client gone), applies a pending weight update, and admits waiting
jobs. A request that arrives while a window runs and could join it (room for its rows)
cuts that window at its next decode step once it has run `cut_after_s`, so it waits a step or
a few, not the rest of a window (the rows of the cut window go on in the next, their KV caches
kept; None: never cut). An engine that keeps no caches across windows (transformers' padded path)
is never cut: there every window re-reads its rows' whole contexts (a 64-token answer in windows of
8 costs 3.3x one window on the embedded model's shapes). When every row of the window before has
ended and fewer new rows are ready than it had, the loop waits up to `gather_s` for the clients of
that window to come back.
Invariants, held here:

* **Bounded.** A window's rows never exceed `max_rows`, and the KV block it allocates (the
  engine's own count, `TorchEngine.window_positions`: rows x (longest kept cache + longest
  suffix + window)) never exceeds `max_positions`. A job is refused (`TooLarge`) when its rows
  alone could exceed it over their whole response; otherwise it waits until it fits. The oldest
  job in flight is always served, so the loop never stalls.
* **One version per window.** Weight updates land between windows; every token carries the
  version of its window (`StepToken.version`).
* **A job left is freed.** Closing a job's stream (its client gone, or done) drops its rows at the
  next window boundary; a window with a streamed job whose rows are all dropped stops at its next
  decode step (a window of whole answers only runs to its end: at most `window_tokens` more).
* **Steps as they are sampled, or a window's at once.** A job that streams (`live`) gets each decode
  step as it is sampled; a whole answer gets its steps at the end of each window and on the step
  a row of it ends, a wake-up of its reader per window instead of one per token (on a small model
  those wake-ups, not the decoding, bound how many requests a second one replica answers). Either
  ends on the step its last row ends, not at its window's end. Its stop strings are then
  found at the window's end: the tokens past one are dropped, as they are from a stream.
* **Same samples.** Counter-based seeds: a row's tokens do not depend on which rows share its
  windows or where windows cut it (`asyncrl.algo.sampling`).

Rows batch together whatever their sampling settings: each row takes its job's own (temperature,
top-p, top-k, min-p, greedy, penalties, logit bias; seed and length are the row's own), per row in
one decode step (`asyncrl.engines.row_sampling`), so a client with settings of its own waits for
room, not for the jobs of other settings to finish. The alternatives computed are the most any
job asks for; each job gets its own count.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter
from typing import Callable

import msgspec

from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.engines.batch_jobs import BatchJob, BatchRow, JobSteps, StepToken, TooLarge, ids_of, step_token
from asyncrl.messages.structs import FinishReason

log = logging.getLogger(__name__)


class WindowBatcher:
    """Continuous batching over `engine` (a `TorchEngine`); see the module's invariants."""

    def __init__(self, engine, max_rows: int, window_tokens: int, max_positions: int, gather_s: float = 0.0,
                 cut_after_s: float | None = None):
        self.engine, self.max_rows, self.window_tokens, self.max_positions = engine, max_rows, window_tokens, max_positions
        self.gather_s = gather_s
        self.cut_after_s = cut_after_s if engine.keeps_caches else None  # see the module's docstring
        if cut_after_s is not None and self.cut_after_s is None:
            log.info("policy endpoint: windows are not cut for requests that arrive mid-window (the "
                     "engine re-reads every context each window, so a cut would cost a window's prefill)")
        self._last_rows = 0  # the rows of the window before
        self._jobs: list[BatchJob] = []  # in arrival order: those running first, then those waiting
        self._wake = asyncio.Event()
        self._update: tuple[Callable[[], None], asyncio.Future] | None = None
        self._task: asyncio.Task | None = None
        self._running: int | None = None  # the rows of the window in progress
        self._window_started = 0.0
        self._cut = threading.Event()  # read by the engine's thread after each decode step
        # jobs taken, jobs whose caller left before their end, tokens sampled, windows, rows over them,
        # windows a request that could join asked to cut.
        self.counters: Counter = Counter(dict.fromkeys(("jobs", "jobs_left", "tokens", "windows", "window_rows",
                                                        "generate_ms", "windows_cut"), 0))

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def context_tokens(self) -> int:
        return self.engine.max_positions

    def check(self, sequences: list[SequenceInput]) -> None:
        """Refuse a job that could never run: more rows than a window holds, or a KV block over the
        bound at its longest (every row at its longest prompt plus its whole response and a window)."""
        if len(sequences) > self.max_rows:
            raise TooLarge(f"{len(sequences)} sequences (prompts x n) in one request; a window holds "
                           f"{self.max_rows} (serve.max_batch_sequences)")
        longest = max(len(s.prompt_ids) + s.max_response_tokens for s in sequences)
        positions = len(sequences) * (longest + self.window_tokens - 1)
        if positions > self.max_positions:
            raise TooLarge(f"{len(sequences)} sequence(s) x (longest prompt + max_tokens + window "
                           f"{self.window_tokens}) is {positions} token positions of KV cache; the bound is "
                           f"{self.max_positions} (serve.max_kv_mb)")

    def stream(self, sequences: list[SequenceInput], params: SamplingParams, live: bool = True) -> "JobSteps":
        """Start a job: its tokens (`JobSteps`), as they are sampled (`live`), else at the end of
        each window."""
        self.check(sequences)
        job = BatchJob(params, asyncio.Queue(), live=live)
        job.rows = [BatchRow(job, i, msgspec.structs.replace(s, key=f"{uuid.uuid4().hex}/{i}"))
                    for i, s in enumerate(sequences)]
        self._jobs.append(job)
        self.counters["jobs"] += 1
        self._cut_for(job)
        self._start()
        return JobSteps(self, job)

    def _cut_now(self) -> bool:
        """The engine's thread, after each decode step of a window: end the window here?"""
        return self._cut.is_set() and time.perf_counter() - self._window_started >= self.cut_after_s

    def _cut_for(self, job: BatchJob) -> None:
        """Cut the window in progress at its next decode step when `job` could join the next one.
        (The KV bound is checked when the next window is planned: a job that does not fit it then
        waits, at the price of one window cut short.)"""
        if (self.cut_after_s is not None and self._running is not None
                and self._running + len(job.rows) <= self.max_rows):
            self._cut.set()

    async def load(self, apply: Callable[[], None]) -> None:
        """Run `apply` (a weight load into the engine) between two windows; returns once done."""
        future = asyncio.get_running_loop().create_future()
        if self._update is not None:  # a newer version replaces one not yet applied
            self._update[1].set_result(None)
        self._update = (apply, future)
        self._start()
        self._wake.set()
        await future

    def stats(self) -> dict:
        live = [j for j in self._jobs if j.live_rows()]
        return {"running_requests": sum(j.started for j in live), "waiting_requests": sum(not j.started for j in live),
                "running_sequences": sum(len(j.live_rows()) for j in live if j.started),
                "largest_kv_block_positions": self.engine.largest_block_positions,
                "kv_bound_positions": self.max_positions, **self.counters}

    # --- the loop ---------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._task is None or self._task.done():  # (a new event loop: a new wake-up for it)
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._apply_update()
            self._jobs = [j for j in self._jobs if j.live_rows()]
            if self._starts_afresh() and self._live_rows() < self._last_rows:
                await self._gather()
                self._jobs = [j for j in self._jobs if j.live_rows()]
            rows = self._plan()
            self._last_rows = len(rows)
            if not rows:
                continue
            self._wake.set()  # more windows follow while rows are left
            try:
                await self._window(rows)
            except Exception as exc:  # the engine failed: the jobs of this window fail with it
                for job in {r.job for r in rows}:
                    job.queue.put_nowait(exc)
                    for row in job.rows:
                        row.done = True

    def _live_rows(self) -> int:
        return sum(len(j.live_rows()) for j in self._jobs)

    def _starts_afresh(self) -> bool:
        """No row of the window before goes on: the next window holds only new requests."""
        return not any(j.started for j in self._jobs if j.live_rows())

    async def _gather(self) -> None:
        """Wait up to `gather_s` while fewer rows are ready than the window before had, when
        every row of that window has ended. Clients whose answers ended with it send their next
        requests a few milliseconds apart; a window started for the first of them would keep the
        others waiting a whole window. (While rows go on, their window runs at once: a wait there
        would tax every window in which some answer ended.)"""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.gather_s
        while self._live_rows() < self._last_rows and (left := deadline - loop.time()) > 0:
            self._wake.clear()
            try:  # (not `wait_for`: on 3.11 it can swallow a cancellation that races its timeout)
                async with asyncio.timeout(left):
                    await self._wake.wait()
            except TimeoutError:
                break
        self._wake.set()  # what came meanwhile (a weight update too) is the loop's next pass

    async def _apply_update(self) -> None:
        if self._update is None:
            return
        (apply, future), self._update = self._update, None
        try:
            await asyncio.to_thread(apply)
            future.set_result(None)
        except Exception as exc:  # the follower reports it; the old weights keep serving
            future.set_exception(exc)

    def _plan(self) -> list[BatchRow]:
        """This window's rows: the jobs in flight, oldest first, while they fit."""
        rows: list[BatchRow] = []
        for job in self._jobs:
            candidate = rows + job.live_rows()
            window = self._window_tokens(candidate)
            if rows and (len(candidate) > self.max_rows or
                         self.engine.window_positions(self._inputs(candidate), window) > self.max_positions):
                continue  # waits for a later window (a smaller job behind it may still fit)
            rows = candidate
            job.started = True
        return rows

    def _window_tokens(self, rows: list[BatchRow]) -> int:
        return min(self.window_tokens, max(r.sequence.max_response_tokens - len(r.response) for r in rows))

    @staticmethod
    def _inputs(rows: list[BatchRow]) -> list[SequenceInput]:
        return [msgspec.structs.replace(r.sequence, response_ids=ids_of(r.response)) for r in rows]

    async def _window(self, rows: list[BatchRow]) -> None:
        loop, version, window = asyncio.get_running_loop(), self.engine.weight_version, self._window_tokens(rows)
        live = any(r.job.live for r in rows)

        def on_step(items: list[tuple]) -> bool:  # the engine's thread
            loop.call_soon_threadsafe(self._dispatch, rows, items, version)
            return any(not r.done and not r.job.closed for r in rows)

        def on_end(ended: list[tuple]) -> None:  # the engine's thread
            loop.call_soon_threadsafe(self._deliver_ended, rows, ended, version)

        # No job of this window streams: its steps are read from the outputs, with no call back per
        # step (a client gone mid-window is dropped at the window's end, at most a window later),
        # but a row that ends is handed over on the step it ends (`on_end`).
        start = time.perf_counter()
        self._running, self._window_started = len(rows), time.perf_counter()
        self._cut.clear()
        try:
            params = [r.job.params for r in rows]
            outputs = await asyncio.to_thread(self.engine.generate_window_sync, self._inputs(rows), window, params,
                                              on_step if live else None, self._cut_now, None if live else on_end)
        finally:
            self._running = None
        self.counters["windows_cut"] += self._cut.is_set()
        self.counters["windows"] += 1
        self.counters["window_rows"] += len(rows)
        self.counters["generate_ms"] += int(1000 * (time.perf_counter() - start))
        if not live:
            self._hold_outputs(rows, outputs, version)
        for row, out in zip(rows, outputs):
            row.response += out.token_ids.tolist()
            if out.finish_reason is not FinishReason.WINDOW:
                row.done = True
        for job in {r.job for r in rows}:
            self._hand_over(job)

    @staticmethod
    def _hand_over(job: BatchJob) -> None:
        """What `job` holds, to its reader; its end too once every row has ended (once)."""
        if job.held:
            job.queue.put_nowait(job.held)
            job.held = []
        if not job.live_rows() and not job.ended:
            job.ended = True
            job.queue.put_nowait(None)

    def _deliver_ended(self, rows: list[BatchRow], ended: list[tuple], version: int) -> None:
        """Rows of a window of whole answers that ended on a step: their tokens to their jobs now,
        and a job whose every row has ended is done (its client need not wait for the window)."""
        self._hold_outputs([rows[i] for i, _ in ended], [out for _, out in ended], version)
        for i, _ in ended:
            rows[i].done = True
        for job in {rows[i].job for i, _ in ended}:
            self._hand_over(job)

    def _hold_outputs(self, rows: list[BatchRow], outputs: list, version: int) -> None:
        """A window's tokens, row by row, as the steps `_dispatch` would have held for them (a row
        already handed over, done, is not)."""
        for row, out in zip(rows, outputs):
            if row.done or row.job.closed:
                continue
            k, n = row.job.params.top_logprobs, len(out.token_ids)
            tokens, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
            top_ids = out.top_ids[:, :k].tolist() if k and out.top_ids is not None else None
            top_lps = out.top_logprobs[:, :k].tolist() if top_ids is not None else None
            row.job.held += [step_token(row, tokens[i], logprobs[i], out.finish_reason if i == n - 1 else None,
                                         (top_ids[i], top_lps[i]) if top_ids is not None else None, version)
                             for i in range(n)]
            self.counters["tokens"] += n

    def _dispatch(self, rows: list[BatchRow], items: list[tuple], version: int) -> None:
        """One decode step's tokens to their jobs (on the loop, in order)."""
        by_job: dict[BatchJob, list[StepToken]] = {}
        ended: set[BatchJob] = set()
        for index, token, logprob, reason, top in items:
            row = rows[index]
            if row.done or row.job.closed:
                continue
            by_job.setdefault(row.job, []).append(step_token(row, token, logprob, reason, top, version))
            self.counters["tokens"] += 1
            if reason is not None and reason is not FinishReason.WINDOW:
                row.done = True  # (its job's stream can end now, not at the window's end)
                ended.add(row.job)
        for job, steps in by_job.items():
            if job.live:
                job.queue.put_nowait(steps)
            else:
                job.held += steps
            if job in ended:  # a row ended: a whole answer gets what it has so far now
                self._hand_over(job)
