"""Generator: runs engine windows in a loop and streams `Segment`s.

Each turn advances every in-flight sequence by at most one window. Unfinished sequences continue
next turn and have priority; new prompts fill freed slots (a prompt's G samples are admitted
together). Every token is tagged with the weight version that produced it. Weight updates are
applied between windows, or at once where the engine takes them while windows run
(`Engine.updates_mid_window`: SGLang, which reports each token's version).

A `PromptRequest` is acknowledged only when all of its samples (G, or those it names) have emitted their final
segment, so a generator that dies mid-prompt loses nothing: the lease expires, another generator
regenerates the prompt with the same seeds, and the assembler drops segment ids it already has.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from asyncrl.engines.base import Engine, SamplingParams, long_tail_min_tokens
from asyncrl.generation import sequence_input
from asyncrl.mailbox import Mailbox
from asyncrl.schema import FinishReason, PromptRequest, Segment
from asyncrl.weight_sync import Delivery, WeightGroup, from_cuda_ipc


@dataclass
class _Sequence:
    request: PromptRequest
    sample_idx: int
    turn: int = 0
    response_ids: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    min_response_tokens: int = 0  # drawn once at admission (long-tail workload), not per window


class Generator:
    def __init__(self, engine: Engine, prompts: Mailbox, segments: Mailbox, params: SamplingParams,
                 window_tokens: int, max_response_tokens: int, max_windows: int, max_inflight: int,
                 generator_id: str = "gen-0", long_tail: tuple[float, int] = (0.0, 0)):
        self.engine = engine
        self.prompts = prompts
        self.segments = segments
        self.params = params
        self.window_tokens = window_tokens
        self.max_response_tokens = max_response_tokens
        self.max_windows = max_windows
        self.max_inflight = max_inflight
        self.generator_id = generator_id
        self.long_tail = long_tail  # (fraction, tokens): the long-tail benchmark workload
        self.inflight: list[_Sequence] = []
        self.samples_left: dict[str, int] = {}  # prompt id -> samples not yet finished
        self._pending_update: tuple[Delivery, object, asyncio.Future] | None = None
        self.weight_group: WeightGroup | None = None  # the distributed path, when this generator is on another host
        self._emitting: asyncio.Future | None = None  # the previous window's segments being sent
        self._last_group_size = 1  # samples of the last prompt taken (admission asks when it fits)
        self._running = False
        self._started = time.monotonic()
        # admit_s: taking prompts while sequences are running; prepare_s: building a window's inputs
        # and turning its outputs into segments (the generator's own work between windows).
        self.timing = {"generate_s": 0.0, "weight_update_s": 0.0, "wait_prompts_s": 0.0, "wait_mailbox_s": 0.0,
                       "admit_s": 0.0, "prepare_s": 0.0}
        self.counters = {"windows": 0, "tokens": 0, "segments": 0, "samples_finished": 0, "prompts_admitted": 0,
                         "weight_updates": 0}

    # --- weight updates (called by the learner) -------------------------------------------------

    async def receive_weights(self, delivery: Delivery, payload=None) -> float:
        """Take version `delivery.version` between windows (at once if the engine updates mid-window),
        by its path (`asyncrl.weight_sync`): `payload` is the shared-memory arrays (shm) or the CUDA
        IPC handles; the group path receives by broadcast. Returns the seconds generation paused for it."""
        if self.engine.updates_mid_window:
            return await self._apply(delivery, payload)
        future = asyncio.get_running_loop().create_future()
        self._pending_update = (delivery, payload, future)
        return await future

    def _load(self, delivery: Delivery, payload) -> None:
        if delivery.path == "shm":
            self.engine.adopt_shared(payload, delivery.version)
        elif delivery.path == "cuda_ipc":
            self.engine.update_weights(from_cuda_ipc(payload), delivery.version)
        elif delivery.path == "group":
            if self.weight_group is None:
                raise RuntimeError(f"{self.generator_id}: a group delivery, but this generator joined no weight group")
            self.engine.update_weights(self.weight_group.receive(delivery.plan, delivery.version), delivery.version)
        else:
            raise ValueError(f"unknown weight path {delivery.path!r}")

    async def _apply_pending_update(self) -> None:
        if self._pending_update is None:
            return
        delivery, payload, future = self._pending_update
        self._pending_update = None
        try:
            paused = await self._apply(delivery, payload)
        except Exception as exc:
            future.set_exception(exc)
            raise
        future.set_result(paused)

    async def _apply(self, delivery: Delivery, payload) -> float:
        start = time.perf_counter()
        await asyncio.to_thread(self._load, delivery, payload)
        paused = time.perf_counter() - start
        self.timing["weight_update_s"] += paused
        self.counters["weight_updates"] += 1
        return paused

    # --- the loop --------------------------------------------------------------------------------

    async def _admit(self) -> None:
        """Fill free slots with whole prompts (all G samples together). A prompt that does not fit
        goes back to the mailbox; the cap is exceeded only by a lone group larger than the cap."""
        while len(self.inflight) < self.max_inflight:
            # Ask only when the last prompt's group would fit: a prompt that does not fit costs a
            # get and a nack (two mailbox round trips) for nothing, every window.
            if self.inflight and len(self.inflight) + self._last_group_size > self.max_inflight:
                return
            # Wait for prompts only when idle; otherwise take what is there without blocking.
            start = time.perf_counter()
            requests = await self.prompts.get(1, timeout=0.0 if self.inflight else 0.2)
            if not self.inflight:
                self.timing["wait_prompts_s"] += time.perf_counter() - start
            if not requests:
                return
            request = requests[0]
            samples = request.samples
            self._last_group_size = len(samples)
            if self.inflight and len(self.inflight) + len(samples) > self.max_inflight:
                await self.prompts.nack([request.prompt_id])
                return
            self.samples_left[request.prompt_id] = len(samples)
            self.inflight += [_Sequence(request, i, min_response_tokens=long_tail_min_tokens(request.seed + i, *self.long_tail))
                              for i in samples]
            self.counters["prompts_admitted"] += 1

    async def step(self, overlap: bool = False) -> None:
        """One turn: apply a pending update, admit prompts, generate a window, emit segments.

        With `overlap` (the run loop) the segments are sent, and finished prompts acknowledged,
        while the next window generates: the engine runs in a thread, so the event loop is free.
        One emission is in flight at most, so order and mailbox backpressure are kept."""
        await self._apply_pending_update()
        start = time.perf_counter()
        busy = bool(self.inflight)
        await self._admit()
        if busy:
            self.timing["admit_s"] += time.perf_counter() - start
        if not self.inflight:
            return
        start = time.perf_counter()
        batch = self.inflight[: self.max_inflight]
        inputs = [sequence_input(s.request.prompt_token_ids, s.request.seed + s.sample_idx, self.max_response_tokens,
                                 s.response_ids, s.min_response_tokens) for s in batch]
        version = self.engine.version
        self.timing["prepare_s"] += time.perf_counter() - start
        start = time.perf_counter()
        outputs = await self.engine.generate_window(inputs, self.window_tokens, self.params)
        self.timing["generate_s"] += time.perf_counter() - start
        self.counters["windows"] += 1
        start = time.perf_counter()

        segments, finished_prompts, still_running = [], [], []
        for seq, out in zip(batch, outputs):
            finished = out.finished or (self.max_windows > 0 and seq.turn + 1 >= self.max_windows)
            # The K-th window ends a response whether or not it reached EOS.
            reason = out.finish_reason if out.finished or not finished else FinishReason.MAX_LENGTH
            segments.append(
                Segment(
                    prompt_id=seq.request.prompt_id,
                    sample_idx=seq.sample_idx,
                    turn=seq.turn,
                    group_id=seq.request.prompt_id,
                    prompt_token_ids=seq.request.prompt_token_ids,
                    prior_response_ids=np.asarray(seq.response_ids, dtype=np.int32),
                    prior_versions=np.asarray(seq.versions, dtype=np.int32),
                    new_token_ids=out.token_ids,
                    new_logprobs=out.logprobs,
                    new_versions=(out.versions if out.versions is not None
                                  else np.full(len(out.token_ids), version, dtype=np.int32)),
                    finished=finished,
                    finish_reason=reason,
                    data_source=seq.request.data_source,
                    ground_truth=seq.request.ground_truth,
                    seed=seq.request.seed + seq.sample_idx,
                    generator_id=self.generator_id,
                    group_size=seq.request.group_size,
                )
            )
            self.counters["tokens"] += len(out.token_ids)
            if finished:
                self.counters["samples_finished"] += 1
                self.samples_left[seq.request.prompt_id] -= 1
                if self.samples_left[seq.request.prompt_id] == 0:
                    del self.samples_left[seq.request.prompt_id]
                    finished_prompts.append(seq.request.prompt_id)
            else:
                seq.response_ids += out.token_ids.tolist()
                seq.versions += segments[-1].new_versions.tolist()
                seq.turn += 1
                still_running.append(seq)
        # Continuations first, in their original order; sequences outside this batch keep theirs.
        self.inflight = still_running + self.inflight[len(batch):]
        self.timing["prepare_s"] += time.perf_counter() - start
        await self.flush()
        emission = self._emit(segments, finished_prompts)
        if overlap:
            self._emitting = asyncio.ensure_future(emission)
        else:
            await emission

    async def _emit(self, segments: list[Segment], finished_prompts: list[str]) -> None:
        # A prompt is acknowledged only after its last segments are in the mailbox.
        await self.segments.put(segments)
        self.counters["segments"] += len(segments)
        if finished_prompts:
            await self.prompts.ack(finished_prompts)

    async def flush(self) -> None:
        """Wait for the emission in flight (time blocked here is mailbox backpressure)."""
        if self._emitting is not None:
            start = time.perf_counter()
            emitting, self._emitting = self._emitting, None
            await emitting
            self.timing["wait_mailbox_s"] += time.perf_counter() - start

    async def run(self) -> None:
        self._running = True
        self._started = time.monotonic()
        try:
            while self._running:
                await self.step(overlap=True)
        finally:
            await self.flush()

    def stop(self) -> None:
        self._running = False

    def stats(self) -> dict:
        wall = max(time.monotonic() - self._started, 1e-9)
        return {
            **self.counters,
            **self.timing,
            "generator_id": self.generator_id,
            "version": self.engine.version,
            "inflight_sequences": len(self.inflight),
            "wall_s": wall,
            "busy_fraction": self.timing["generate_s"] / wall,
            "paused_for_weights_fraction": self.timing["weight_update_s"] / wall,
        }
