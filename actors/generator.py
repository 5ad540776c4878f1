"""Generator: runs engine windows in a loop and streams `Segment`s (the role, its builder, its Ray shell).

Each turn advances every in-flight sequence by at most one window. Unfinished sequences continue
next turn and have priority; new prompts fill freed slots (a prompt's G samples are admitted
together). Every token is tagged with the weight version that produced it. Weight updates are
applied between windows: at once when no window runs (an idle generator waiting for prompts must
not hold the version that would admit them), else when the window ends; or at once where the
engine takes them while windows run (`Engine.updates_mid_window`: SGLang, which reports each
token's version).

A `PromptRequest` is acknowledged only when all of its samples (G, or those it names) have emitted their final
segment, so a generator that dies mid-prompt loses nothing: its leases go back, another generator
regenerates the prompt with the same seeds, and the assembler keeps one copy of each sample. The
leases of the prompts it works on are renewed (every quarter of `lease_s`), so work longer than a
lease is not handed to a second generator; a prompt leased to it again is not started twice.
`stats()` reports the age of its oldest engine call in progress (`engine_call_s`): its liveness.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import msgspec
import numpy as np
import torch

from actors.base import RoleShell, WeightGroupMember
from asyncrl.config import EngineConfig, EnvironmentConfig, ModelConfig, SamplingConfig
from asyncrl.engines.base import Engine, SamplingParams, long_tail_min_tokens
from asyncrl.engines.generation import EngineCalls, build_generator_engine, sequence_input
from asyncrl.engines.sequences import GeneratedSequence, ParkedEpisode, window_segment, with_observation
from asyncrl.environments.episodes import EnvironmentClient, Episodes, build_episodes, observation_of
from asyncrl.environments.tools import Episode
from asyncrl.messages.mailbox import Mailbox, keep_leases
from asyncrl.messages.structs import FinishReason, Segment, sample_id
from asyncrl.weights import transport
from asyncrl.weights.sync import Delivery, WeightGroup


class Generator:
    def __init__(self, engine: Engine, prompts: Mailbox, segments: Mailbox, params: SamplingParams,
                 window_tokens: int, max_response_tokens: int, max_windows: int, max_inflight: int,
                 generator_id: str = "gen-0", long_tail: tuple[float, int] = (0.0, 0),
                 episodes: Episodes | None = None, lease_s: float = 600.0, precision: dict | None = None):
        self.engine = engine
        self.precision = precision or {}  # the engine's, as chosen at start-up (`asyncrl.models.precision`)
        self.prompts = prompts
        self.segments = segments
        self.params = params
        self.window_tokens = window_tokens
        self.max_response_tokens = max_response_tokens
        self.max_windows = max_windows
        self.max_inflight = max_inflight
        self.generator_id = generator_id
        self.long_tail = long_tail  # (fraction, tokens): the long-tail benchmark workload
        self.inflight: list[GeneratedSequence] = []
        self.episodes = episodes  # a task with an environment: each sample is an episode of turns
        self.parked: list[ParkedEpisode] = []  # episodes waiting for an observation (they hold their slot)
        self.samples_left: dict[str, int] = {}  # prompt id -> samples not yet finished
        self._pending_update: tuple[Delivery, object, asyncio.Future] | None = None
        self._engine_lock = asyncio.Lock()  # held by a window and by a weight load: never both at once
        self.weight_group: WeightGroup | None = None  # the distributed path, when this generator is on another host
        self._emitting: asyncio.Future | None = None  # the previous window's segments being sent
        # Samples of the last prompt taken (admission asks for as many as fit); none yet: ask for one.
        self._last_group_size = max_inflight
        self._running = False
        self._loop_ended: asyncio.Event | None = None  # set once run() has sent its last emission
        self._admitting = True  # False once draining: in-flight sequences finish, nothing new starts
        self.idle_wait_s = 0.2  # an idle generator's wait for a prompt, per mailbox call (then its loop turns)
        self.renew_every_s = lease_s / 4  # the prompts' leases are renewed this often while it holds them
        self.engine_calls = EngineCalls()  # windows and loads in progress: the pool's liveness
        self._started = time.monotonic()
        # admit_s: taking prompts while running; prepare_s: a window's inputs and segments (its own work).
        self.timing = {"generate_s": 0.0, "weight_update_s": 0.0, "wait_prompts_s": 0.0, "wait_mailbox_s": 0.0,
                       "admit_s": 0.0, "prepare_s": 0.0}
        self.counters = dict.fromkeys(("windows", "tokens", "segments", "samples_finished", "prompts_admitted",
                                       "weight_updates", "tool_calls", "tool_errors", "malformed_calls", "observation_tokens",
                                       "leases_renewed", "leases_lost", "prompts_held_again"), 0)

    # --- weight updates (called by the learner) -------------------------------------------------

    async def receive_weights(self, delivery: Delivery, payload=None) -> float:
        """Take version `delivery.weight_version` between windows (at once if the engine updates
        mid-window), by its path (`asyncrl.weights.transport`): `payload` is the shared-memory layout (shm)
        or the CUDA IPC handles; the group path receives by broadcast. Returns the seconds
        generation paused for it."""
        if not self._running:  # joining the pool (its loop starts after this) or stopped: load now
            start = time.perf_counter()
            await self._load_engine(delivery, payload)  # stopped: after a last window still running
            return time.perf_counter() - start
        if self.engine.updates_mid_window or not self._engine_lock.locked():
            # No window runs: the next one waits for this load (the lock's waiters go in turn). An
            # idle generator would otherwise hold the version until a prompt came, and the prompts
            # come only once every generator holds it (the admission budget).
            return await self._load(delivery, payload)
        future = asyncio.get_running_loop().create_future()
        self._pending_update = (delivery, payload, future)
        return await future

    async def _apply_pending_update(self) -> None:
        if self._pending_update is None:
            return
        delivery, payload, future = self._pending_update
        self._pending_update = None
        try:
            paused = await self._load(delivery, payload)
        except Exception as exc:
            future.set_exception(exc)
            raise
        future.set_result(paused)

    async def _load_engine(self, delivery: Delivery, payload) -> None:
        # An engine that updates mid-window loads beside the window it runs; the others between two.
        async with contextlib.nullcontext() if self.engine.updates_mid_window else self._engine_lock:
            async with self.engine_calls.call("load"):
                await asyncio.to_thread(transport.load, self.engine, delivery, payload, self.weight_group)

    async def _load(self, delivery: Delivery, payload) -> float:
        start = time.perf_counter()
        await self._load_engine(delivery, payload)
        paused = time.perf_counter() - start
        self.timing["weight_update_s"] += paused
        self.counters["weight_updates"] += 1
        return paused

    # --- the loop --------------------------------------------------------------------------------

    async def _admit(self) -> None:
        """Fill free slots with whole prompts (all G samples together), as many as fit in one
        mailbox call. A prompt that does not fit goes back to the mailbox; the cap is exceeded
        only by a lone group larger than the cap."""
        while self._admitting and self.held < self.max_inflight:
            free = self.max_inflight - self.held
            # Ask only when the last prompt's group would fit: a prompt that does not fit costs a
            # get and a nack (two mailbox round trips) for nothing, every window.
            if self.held and self._last_group_size > free:
                return
            asked = max(1, free // self._last_group_size)
            # Wait for prompts only when idle; otherwise take what is there without blocking.
            start = time.perf_counter()
            requests = await self.prompts.get(asked, timeout=0.0 if self.held else self.idle_wait_s, consumer=self.generator_id)
            if not self.held:
                self.timing["wait_prompts_s"] += time.perf_counter() - start
            returned = []
            for request in requests:
                if request.prompt_id in self.samples_left:
                    # Its lease expired and came back to it, still at work on it: no second copy.
                    self.counters["prompts_held_again"] += 1
                    continue
                samples = request.samples
                self._last_group_size = len(samples)
                if returned or (self.held and self.held + len(samples) > self.max_inflight):
                    returned.append(request.prompt_id)
                    continue
                self.samples_left[request.prompt_id] = len(samples)
                self.inflight += [GeneratedSequence(request, i, min_response_tokens=long_tail_min_tokens(request.seed + i, *self.long_tail))
                                  for i in samples]
                self.counters["prompts_admitted"] += 1
            if returned:
                await self.prompts.nack(returned, consumer=self.generator_id)
            if returned or len(requests) < asked:  # full, or the mailbox had no more just now
                return

    @property
    def held(self) -> int:
        """Sequences this generator holds: running, or waiting for an observation."""
        return len(self.inflight) + len(self.parked)

    async def step(self, overlap: bool = False) -> None:
        """One turn: apply a pending update, take back episodes whose observation came, admit
        prompts, generate a window, emit segments.

        With `overlap` (the run loop) the segments are sent, and finished prompts acknowledged,
        while the next window generates: the engine runs in a thread, so the event loop is free.
        One emission is in flight at most, so order and mailbox backpressure are kept."""
        await self._apply_pending_update()
        segments, finished_prompts = self._observed()
        start = time.perf_counter()
        busy = bool(self.inflight)
        await self._admit()
        if busy:
            self.timing["admit_s"] += time.perf_counter() - start
        if self.inflight:
            await self._window(segments, finished_prompts)
        elif self.parked and not segments:  # every sequence waits for a tool: wait for the first answer
            await asyncio.wait([p.observing for p in self.parked], timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
        if not segments and not finished_prompts:
            return
        await self.flush()
        emission = self._emit(segments, finished_prompts)
        if overlap:
            self._emitting = asyncio.ensure_future(emission)
        else:
            await emission

    async def _window(self, segments: list[Segment], finished_prompts: list[str]) -> None:
        """Advance the running sequences by one engine window; their segments go to `segments`."""
        start = time.perf_counter()
        batch = self.inflight[: self.max_inflight]
        inputs = [sequence_input(s.request.prompt_token_ids, s.request.seed + s.sample_idx, self.max_response_tokens,
                                 s.response_ids, s.min_response_tokens, key=sample_id(s.request.prompt_id, s.sample_idx),
                                 images=s.request.images)
                  for s in batch]
        self.timing["prepare_s"] += time.perf_counter() - start
        async with self._engine_lock:
            start = time.perf_counter()
            version = self.engine.weight_version
            async with self.engine_calls.call("window"):
                outputs = await self.engine.generate_window(inputs, self.window_tokens, self.params)
        self.timing["generate_s"] += time.perf_counter() - start
        self.counters["windows"] += 1
        start = time.perf_counter()
        still_running = []
        for seq, out in zip(batch, outputs):
            segment, called = self._advance(seq, out, version)
            self.counters["tokens"] += len(segment.new_token_ids)
            if segment.finished:
                segments.append(segment)
                self._finish(seq, finished_prompts)
            elif called:  # the segment waits for its observation
                turn = seq.response_ids[seq.turn_start:] + segment.new_token_ids.tolist()
                observing = asyncio.ensure_future(self.episodes.observe(turn, Episode(seq.request.prompt_id,
                                                                                      seq.sample_idx)))
                self.parked.append(ParkedEpisode(seq, segment, observing))
            else:
                segments.append(segment)
                seq.extend(segment, self.episodes is not None)
                still_running.append(seq)
        # Continuations first, in their original order; sequences outside this batch keep theirs.
        self.inflight = still_running + self.inflight[len(batch):]
        self.timing["prepare_s"] += time.perf_counter() - start

    def _advance(self, seq: GeneratedSequence, out, version: int) -> tuple[Segment, bool]:
        """The segment of one sequence's window, and whether its turn ended in a tool call (the
        window is cut just after the token that completes the call)."""
        versions = out.versions if out.versions is not None else np.full(len(out.token_ids), version, dtype=np.int32)
        arrays = [out.token_ids, out.logprobs, versions, out.scored, out.routes]  # per token (scored, routes: or None)
        called = self.episodes.call_end(seq.response_ids[seq.turn_start:], out.token_ids) if self.episodes else None
        last_window = self.max_windows > 0 and seq.window + 1 >= self.max_windows
        if called is not None:
            arrays = [None if a is None else a[:called] for a in arrays]
            finished = seq.tool_calls >= self.episodes.max_turns or last_window
            reason = (FinishReason.MAX_TURNS if seq.tool_calls >= self.episodes.max_turns else
                      FinishReason.MAX_LENGTH if last_window else FinishReason.TOOL_CALL)
        else:
            finished = out.finished or last_window
            # The K-th window ends a response whether or not it reached EOS.
            reason = out.finish_reason if out.finished or not finished else FinishReason.MAX_LENGTH
        return window_segment(seq, self.generator_id, *arrays, finished, reason), called is not None and not finished

    def _finish(self, seq: GeneratedSequence, finished_prompts: list[str]) -> None:
        self.counters["samples_finished"] += 1
        self.samples_left[seq.request.prompt_id] -= 1
        if self.samples_left[seq.request.prompt_id] == 0:
            del self.samples_left[seq.request.prompt_id]
            finished_prompts.append(seq.request.prompt_id)

    def _observed(self) -> tuple[list[Segment], list[str]]:
        """Episodes whose observation came back: the segment that ended in the call gains the
        observation's tokens (in the context, never trained: log-prob 0, unscored, marked as an
        observation, the version of the call's last token) and the episode runs again, first in
        line. With no room left for the observation and an answer, the episode ends at its call."""
        segments, finished_prompts, resumed, waiting = [], [], [], []
        for parked in self.parked:
            if not parked.observing.done():
                waiting.append(parked)
                continue
            seq, segment, observation = parked.sequence, parked.segment, observation_of(parked.observing)
            self.counters["tool_calls"] += 1
            self.counters["tool_errors"] += int(observation.error)
            self.counters["malformed_calls"] += int(observation.malformed)
            seq.tool_calls += 1
            n, k = len(segment.new_token_ids), len(observation.token_ids)
            if len(seq.response_ids) + n + k >= self.max_response_tokens:
                segments.append(msgspec.structs.replace(segment, finished=True, finish_reason=FinishReason.MAX_LENGTH))
                self._finish(seq, finished_prompts)
                continue
            segment = with_observation(segment, observation.token_ids, self.engine.weight_version)
            self.counters["observation_tokens"] += k
            segments.append(segment)
            seq.extend(segment, self.episodes is not None)
            seq.turn_start = len(seq.response_ids)
            resumed.append(seq)
        self.parked = waiting
        self.inflight = resumed + self.inflight
        return segments, finished_prompts

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
        self._loop_ended = asyncio.Event()
        self._started = time.monotonic()
        renewing = asyncio.ensure_future(keep_leases(  # beside the windows (the engine runs in a thread)
            self.prompts, lambda: list(self.samples_left), self.generator_id, self.renew_every_s, self.counters))
        try:
            # A draining generator's loop ends once it holds nothing: turning on with nothing to
            # run would await nothing and starve drain(), stats() and receive_weights().
            while self._running and (self._admitting or self.held):
                await self.step(overlap=True)
        finally:
            renewing.cancel()
            await self.flush()
            self._loop_ended.set()

    def stop(self) -> None:
        self._running = False

    async def drain(self, timeout_s: float) -> dict:
        """Leave the pool: admit nothing new, let the sequences in flight finish (up to `timeout_s`),
        hand back the prompts of any still unfinished (their work is regenerated elsewhere), stop."""
        self._admitting = False
        if self._loop_ended is not None:  # the loop ends by itself once its sequences finish
            try:
                await asyncio.wait_for(self._loop_ended.wait(), timeout_s)
            except asyncio.TimeoutError:
                # Stop it: its turn in progress ends (a window at most) and its last segments are
                # sent before this returns, since the pool kills the actor next.
                self._running = False
                await self._loop_ended.wait()
        self._running = False
        handed_back = list(self.samples_left)
        await self.flush()
        if handed_back:
            await self.prompts.nack(handed_back, consumer=self.generator_id)
            for parked in self.parked:
                parked.observing.cancel()
            self.inflight, self.parked, self.samples_left = [], [], {}
        return {"generator_id": self.generator_id, "prompts_handed_back": len(handed_back)}

    def held_samples(self) -> list[str]:
        """Ids of the samples it works on (running, or waiting for an observation)."""
        return sorted(sample_id(q.request.prompt_id, q.sample_idx) for q in [*self.inflight, *(p.sequence for p in self.parked)])

    def stats(self) -> dict:
        wall = max(time.monotonic() - self._started, 1e-9)
        return {**self.counters, **self.timing, "generator_id": self.generator_id,
                "delivered_version": self.engine.weight_version, "inflight_sequences": self.held,
                "engine_call_s": self.engine_calls.oldest_s(getattr(self.engine, "last_step_at", 0.0)),  # liveness
                "wall_s": wall, "busy_fraction": self.timing["generate_s"] / wall,
                "paused_for_weights_fraction": self.timing["weight_update_s"] / wall, "engine_precision": self.precision}


def build_generator(model: ModelConfig, engine: EngineConfig, sampling: SamplingConfig, prompts: Mailbox,
                    segments: Mailbox, generator_id: str, environment: EnvironmentConfig | None = None,
                    environment_endpoint=None, template_kwargs: dict | None = None, lease_s: float = 600.0) -> Generator:
    """A generator from its sections: the engine (embedded or SGLang) and its windows; with an
    environment, each sample is an episode whose tool calls the endpoint answers, its observations
    rendered by the chat template with `template_kwargs` (`task.chat_template_kwargs`) as the prompts were."""
    embedded, precision = build_generator_engine(model, engine)
    max_windows = engine.max_windows or math.ceil(engine.max_response_tokens / engine.window_tokens)
    episodes = None
    if environment is not None and environment.enabled:
        from asyncrl.models.loading import load_tokenizer

        client = EnvironmentClient(environment_endpoint, environment.timeout_s, environment.retries)
        episodes = build_episodes(environment, load_tokenizer(model), client, use_chat_template=model.use_chat_template,
                                  template_kwargs=template_kwargs)
    return Generator(embedded, prompts, segments, SamplingParams.of(sampling), engine.window_tokens,
                     engine.max_response_tokens, max_windows, engine.max_inflight_sequences, generator_id,
                     (engine.long_tail_fraction, engine.long_tail_tokens), episodes, lease_s, precision)


class GeneratorActor(RoleShell, WeightGroupMember):
    def __init__(self, model: ModelConfig, engine: EngineConfig, sampling: SamplingConfig, prompts: Mailbox,
                 segments: Mailbox, generator_id: str, environment: EnvironmentConfig | None = None,
                 environment_endpoint=None, template_kwargs: dict | None = None, lease_s: float = 600.0):
        torch.set_num_threads(engine.threads)
        self.inner = build_generator(model, engine, sampling, prompts, segments, generator_id, environment,
                                     environment_endpoint, template_kwargs, lease_s)

    def inject_fault(self, **faults: float) -> dict:
        """Load tests: weight loads or windows hang (`EngineCalls`) while the generator answers."""
        return self.inner.engine_calls.inject(**faults)

    async def receive_weights(self, delivery: Delivery, payload=None) -> float:
        return await self.inner.receive_weights(delivery, payload)

    async def drain(self, timeout_s: float) -> dict:
        return await self.inner.drain(timeout_s)

    def held_samples(self) -> list[str]:
        return self.inner.held_samples()
