"""Prompt source: walks the dataset (an epoch cursor over a seeded shuffle) and feeds the
generators' prompt mailbox (the role, its builder, its Ray shell).

It holds the admission side of the staleness bound (`asyncrl.staleness.admission_budget`): a
prompt is issued only while the budget allows, counted against the version every generator holds
(`delivered_version`), so generators never run more than `max_staleness_versions` learner steps
ahead of training, and dropped work (dynamic sampling, stale rows, value warm-up) is replaced.
The learner's check at its step is the other side.

It keeps the ledger of samples (`asyncrl.storage.ledger`): it admits every sample it issues, and the
assembler and the learner report how each one moves on and ends (the assembler in one call per
step for all its events).

It retires prompts with no learning signal (`asyncrl.data.retirement`): a solved one sits out an epoch,
an unsolved one comes back as the policy moves (after growing numbers of versions), up to a bound.
When every prompt sits out, the unsolved one due soonest is tried at once (nothing else can be
issued). When every prompt is solved or given up, nothing is left to learn: nothing is generated
for nothing and the status says so (`asyncrl train` stops there; a Serve run keeps serving the
policy and tries the prompt retired longest again every `retest_every_s`, so a swapped reward or a
changed policy brings prompts back). On resume,
the prompts whose samples were open at the checkpoint (and not in a saved batch) are issued again
first, with their ids and seeds, outside the budget they were already counted in.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import random
import time
from typing import Any

import msgspec
import numpy as np
import torch

from actors.base import RoleShell
from asyncrl.algo.selection import curriculum_sources
from asyncrl.config import (NO_BOUND, AlgorithmConfig, EngineConfig, EnvironmentConfig, ModelConfig, RewardConfig,
                            RouteConfig, SamplingConfig, TaskConfig)
from asyncrl.data.files import drop_overlong, load_examples
from asyncrl.data.retirement import Retirements, SampleOutcome
from asyncrl.data.tasks import Example, encode_prompt
from asyncrl.messages.mailbox import Mailbox
from asyncrl.messages.structs import Codec, DropReason, PromptRequest, SampleState
from asyncrl.models.loading import load_tokenizer
from asyncrl.models.vision import image_prep
from asyncrl.staleness import admission_budget
from asyncrl.storage.checkpoint_transfer import WriterClient, local_copy, write_part
from asyncrl.storage.ledger import LedgerSnapshot, SampleLedger


class CursorSnapshot(msgspec.Struct, kw_only=True):
    """The prompt source's part of a checkpoint (msgspec, never pickle)."""

    epoch: int
    index: int
    issued: int
    dropped_prompts: float
    skipped_by_curriculum: int
    ledger: LedgerSnapshot
    # The prompt set when it differs from the task's (Pre-PPO selection), so a resume keeps it.
    examples: list[dict] | None = None
    prompt_token_ids: list[list[int]] | None = None
    # Retired prompts (example id -> reason, until issued, since, times, issue number, until version,
    # given up) and recent group outcomes. A checkpoint from before the last two has five.
    retired: dict[str, list[str | int]] = {}
    outcomes: dict[str, list[str | None]] = msgspec.field(default_factory=dict, name="verdicts")  # its name on disk


SNAPSHOT_CODEC = Codec(CursorSnapshot)
SNAPSHOT_FILE = "prompt_source.msgpack"  # its part of a checkpoint
# The assembler's ledger events: (sample ids, new state, reason of a drop).
LedgerEvent = tuple[list[str], SampleState, "DropReason | None"]


class PromptSource:
    def __init__(self, examples: list[Example], prompt_token_ids: list[list[int]], group_size: int,
                 out: Mailbox, seed: int = 0, prompts_per_step: int = 1, max_staleness_versions: int = NO_BOUND,
                 curriculum: list[tuple[int, list[str]]] | None = None, max_prompts: int = 0,
                 retirements: Retirements | None = None, retest_every_s: float = 30.0):
        if not examples:
            raise ValueError("the prompt source needs at least one example")
        self.curriculum = curriculum or []
        sources = {ex.data_source for ex in examples}
        for start, stage_sources in self.curriculum:
            if stage_sources and not sources & set(stage_sources):
                raise ValueError(f"curriculum stage at step {start} serves {stage_sources}, but the prompts "
                                 f"come from {sorted(sources)}")
        self.skipped_by_curriculum = 0
        self.examples = examples
        self.prompt_token_ids = prompt_token_ids
        self.group_size = group_size
        self.out = out
        self.seed = seed
        self.epoch = 0
        self.index = 0  # position in the current epoch's order
        self.issued = 0
        self._order = self._shuffle(0)
        self._running = False
        self.prompts_per_step = prompts_per_step
        self.max_staleness_versions = max_staleness_versions
        self.delivered_version = 0  # the version every generator holds
        self.dropped_prompts = 0.0
        self._budget_changed = asyncio.Event()
        self.ledger = SampleLedger()
        self.reissue: collections.deque[PromptRequest] = collections.deque()
        self.examples_replaced = False
        self.max_prompts = max_prompts  # 0 = unbounded (mode=generate issues a fixed number)
        self.retirements = retirements or Retirements(group_size)
        self.retest_every_s, self._last_retest = retest_every_s, time.monotonic()
        self._rows_by_id: dict[str, dict] | None = None  # `rows`' index, built when first asked

    @property
    def budget(self) -> int:
        return admission_budget(self.delivered_version, self.max_staleness_versions, self.prompts_per_step,
                                self.dropped_prompts)

    def set_versions(self, weight_version: int, delivered_version: int) -> None:
        """The learner's versions (the one conduit): admission counts what every generator holds."""
        if delivered_version > self.delivered_version:
            self.delivered_version = delivered_version
            self._budget_changed.set()

    def record(self, sample_ids: list[str], state: SampleState, reason: DropReason | None = None) -> None:
        """The ledger event of the assembler or the learner; a drop returns its share of a prompt
        to the admission budget."""
        moved = self.ledger.advance(sample_ids, state, reason)
        if state is SampleState.DROPPED and moved:
            self.dropped_prompts += moved / self.group_size
            self._budget_changed.set()

    def record_events(self, events: list[LedgerEvent], outcomes: list[SampleOutcome]) -> None:
        """The assembler's events since its last call, in one call: ledger moves and samples' rewards."""
        for sample_ids, state, reason in events:
            self.record(sample_ids, state, reason)
        for outcome in outcomes:
            self.retirements.note_outcome(outcome, self.issued, len(self.examples), self.delivered_version)

    def rows(self, prompt_ids: list[str]) -> dict[str, dict | None] | None:
        """The data rows of issued prompts (by the id they were issued under), for the reward
        functions that read them; None: no example of this task has a row (built-in tasks), so
        the caller need not ask again. A row travels from here once per prompt, not with each
        request, segment, batch and checkpoint."""
        if self._rows_by_id is None:  # (built once: the examples change only before the first issue)
            self._rows_by_id = {ex.prompt_id: ex.row for ex in self.examples if ex.row is not None}
        if not self._rows_by_id:
            return None
        return {pid: self._rows_by_id.get(pid.rsplit("@", 1)[0]) for pid in prompt_ids}

    def set_examples(self, examples: list[Example], prompt_token_ids: list[list[int]]) -> None:
        """Replace the prompt set before the first issue (Pre-PPO selection)."""
        if self.issued:
            raise RuntimeError("the prompt set can only change before the first prompt is issued")
        if not examples:
            raise ValueError("the prompt selection is empty")
        self.examples, self.prompt_token_ids = examples, prompt_token_ids
        self._rows_by_id = None
        self.examples_replaced = True
        self.epoch, self.index = 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next_request(self) -> PromptRequest | None:
        """The next prompt in the cursor's order. When every prompt allowed now is retired, the
        cursor stays where it was and the answer is None, or a retired prompt is tried again
        (`_retest`)."""
        allowed = curriculum_sources(self.delivered_version, self.curriculum)
        start, retired_skips = (self.epoch, self.index, self._order), 0
        while True:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            example = self.examples[self._order[self.index]]
            if self.retirements.sits_out(example.prompt_id, self.issued, self.delivered_version):
                self.index += 1
                retired_skips += 1
                if retired_skips > len(self.examples):  # a whole pass: nothing to issue now
                    self.epoch, self.index, self._order = start
                    return self._retest()
                continue
            if allowed is None or example.data_source in allowed:
                break
            # Not in this curriculum stage: it comes back next epoch (stages are validated non-empty).
            self.index += 1
            self.skipped_by_curriculum += 1
        self.retirements.counts["skipped"] += retired_skips
        position = self._order[self.index]
        self.index += 1
        # The prompt id is unique per issue (a prompt recurs every epoch); seeds follow it.
        return self._issue(position, f"{example.prompt_id}@{self.epoch}")

    def _retest(self) -> PromptRequest | None:
        """Every prompt sits out. An unsolved one (not given up) is tried again at once, the one due
        soonest (nothing else can be issued; the retry counts towards its bound); when all are
        solved or given up, the one retired longest, once per `retest_every_s` (a service that
        keeps running)."""
        now = time.monotonic()
        example_id = self.retirements.to_retest(may_retest_solved=now - self._last_retest >= self.retest_every_s)
        if example_id is None:
            return None
        self._last_retest = now
        position = next(i for i, ex in enumerate(self.examples) if ex.prompt_id == example_id)
        return self._issue(position, f"{example_id}@{self.epoch}r{self.issued + 1}")

    def _issue(self, position: int, prompt_id: str) -> PromptRequest:
        example = self.examples[position]
        self.issued += 1
        request = PromptRequest(
            prompt_id=prompt_id,
            prompt_token_ids=np.asarray(self.prompt_token_ids[position], dtype=np.int32),
            group_size=self.group_size,
            data_source=example.data_source,
            ground_truth=example.ground_truth,
            prompt_text=example.text,  # (the row stays here: `rows` hands it to the assembler once)
            seed=(self.seed * 1_000_003 + self.issued) * 1024,
            images=example.images,  # processed, by reference (`build_prompt_source`)
        )
        self.ledger.admit(request)
        self.retirements.issued(request.prompt_id, self.issued)
        return request

    async def _wait_for_budget(self) -> None:
        self._budget_changed.clear()
        try:
            await asyncio.wait_for(self._budget_changed.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass

    async def run(self) -> None:
        self._running = True
        while self._running:
            if self.reissue:
                await self.out.put([self.reissue[0]])
                self.reissue.popleft()
                continue
            requests = self._admissible()
            if requests:
                await self.out.put(requests)
            else:  # no budget, or every prompt is retired: wait for an outcome, or a new version
                await self._wait_for_budget()

    def _admissible(self) -> list[PromptRequest]:
        """The prompts the budget allows now, at most one step's (one mailbox call for them)."""
        requests = []
        while (len(requests) < self.prompts_per_step and self.issued < self.budget
               and not (self.max_prompts and self.issued >= self.max_prompts)):
            request = self.next_request()
            if request is None:
                break
            requests.append(request)
        return requests

    def stop(self) -> None:
        self._running = False

    def stats(self) -> dict:
        by_source = collections.defaultdict(list)
        for example in self.examples:
            by_source[example.data_source].append(example.prompt_id)
        return {"epoch": self.epoch, "index": self.index, "issued": self.issued, "budget": self.budget,
                "delivered_version": self.delivered_version, "dropped_prompts": self.dropped_prompts,
                "skipped_by_curriculum": self.skipped_by_curriculum, "prompts": len(self.examples),
                "reissue_pending": len(self.reissue), "max_prompts": self.max_prompts,
                **self.retirements.stats(len(self.examples), by_source),
                "ledger": self.ledger.state_counts(), "ledger_problems": self.ledger.check()}

    # --- checkpoint and resume -------------------------------------------------------------------

    def snapshot(self) -> CursorSnapshot:
        replaced = self.examples_replaced
        retired, outcomes = self.retirements.snapshot()
        return CursorSnapshot(
            epoch=self.epoch, index=self.index, issued=self.issued, dropped_prompts=self.dropped_prompts,
            skipped_by_curriculum=self.skipped_by_curriculum, ledger=self.ledger.snapshot(),
            examples=[{"prompt_id": e.prompt_id, "messages": e.messages, "ground_truth": e.ground_truth,
                       "data_source": e.data_source} for e in self.examples] if replaced else None,
            prompt_token_ids=[list(map(int, t)) for t in self.prompt_token_ids] if replaced else None,
            retired=retired, outcomes=outcomes)

    def restore(self, snap: CursorSnapshot, held_sample_ids: set[str], delivered_version: int) -> None:
        """Continue from a checkpoint: cursor, budget, ledger; queue the prompts to issue again."""
        if snap.examples is not None:
            self.examples = [Example(**e) for e in snap.examples]
            self.prompt_token_ids = snap.prompt_token_ids
            self.examples_replaced = True
        self.epoch, self.index, self.issued = snap.epoch, snap.index, snap.issued
        self._order = self._shuffle(self.epoch)
        self.dropped_prompts, self.skipped_by_curriculum = snap.dropped_prompts, snap.skipped_by_curriculum
        self.delivered_version = delivered_version
        self.retirements.restore(snap.retired, snap.outcomes)
        self.ledger, reissue = SampleLedger.restore(snap.ledger, held_sample_ids)
        self.reissue = collections.deque(reissue)


def build_prompt_source(model: ModelConfig, task: TaskConfig, algorithm: AlgorithmConfig, prompts_per_step: int,
                        seed: int, prompts: Mailbox, max_prompts: int = 0,
                        environment: EnvironmentConfig | None = None) -> PromptSource:
    """`max_prompts` > 0: issue that many prompts and no more, with no staleness budget (there is no
    learner: `mode=generate`). `environment`: the prompts list its tools (a task with episodes)."""
    tokenizer = load_tokenizer(model)
    examples = load_examples(task, "train")
    images = image_prep(model, tokenizer)
    tokens = [encode_prompt(ex, tokenizer, model.use_chat_template, task.chat_template_kwargs, environment, images)
              for ex in examples]
    if images is not None:  # the requests carry the processed images' references
        examples = [dataclasses.replace(ex, images=images.processed(ex.images)) for ex in examples]
    examples, tokens = drop_overlong(examples, tokens, task.max_prompt_length, "train")
    curriculum = [(stage.start_step, list(stage.data_sources)) for stage in task.curriculum]
    staleness = NO_BOUND if max_prompts else algorithm.max_staleness_versions
    retirements = Retirements(algorithm.group_size, task.retire_after_groups, task.retire_epochs,
                              task.retire_unsolved, algorithm.dynamic_sampling.metric, task.unsolved_retry_versions,
                              task.unsolved_max_retries)
    return PromptSource(examples, tokens, algorithm.group_size, prompts, seed, prompts_per_step, staleness,
                        curriculum, max_prompts=max_prompts, retirements=retirements,
                        retest_every_s=task.retest_every_s)


class PromptSourceActor(RoleShell):
    def __init__(self, model: ModelConfig, task: TaskConfig, algorithm: AlgorithmConfig, prompts_per_step: int,
                 seed: int, prompts: Mailbox, max_prompts: int = 0, environment: EnvironmentConfig | None = None):
        torch.set_num_threads(1)
        self.inner = build_prompt_source(model, task, algorithm, prompts_per_step, seed, prompts, max_prompts,
                                         environment)
        self.restored = False

    async def prepare(self, model: ModelConfig, engine: EngineConfig, sampling: SamplingConfig, task: TaskConfig,
                      reward: RewardConfig, seed: int, endpoints: dict[str, Any]) -> dict:
        """Pre-PPO prompt selection before the first prompt is issued; a no-op when off or resumed
        (a resumed run keeps the selection its checkpoint holds)."""
        from asyncrl.data.pre_ppo import select_prompts
        from asyncrl.rewards.hybrid import build_reward_router

        if task.pre_ppo_fraction <= 0 or self.restored:
            return {}
        router = build_reward_router(reward, endpoints, [RouteConfig(match="*", endpoints=[task.pre_ppo_endpoint])])
        examples, tokens, selection = await select_prompts(
            self.inner.examples, self.inner.prompt_token_ids, model, engine, sampling, task, router, seed)
        self.inner.set_examples(examples, tokens)
        return selection

    def set_versions(self, weight_version: int, delivered_version: int) -> None:
        self.inner.set_versions(weight_version, delivered_version)

    def record(self, sample_ids: list[str], state: SampleState, reason: DropReason | None = None) -> None:
        self.inner.record(sample_ids, state, reason)

    def record_events(self, events, outcomes) -> None:
        self.inner.record_events(events, outcomes)

    def rows(self, prompt_ids: list[str]) -> dict[str, dict | None] | None:
        return self.inner.rows(prompt_ids)

    async def save_checkpoint_part(self, directory: str, writer: WriterClient) -> None:
        """The cursor and ledger into the checkpoint being written at `directory` (through the run
        directory's `writer` where this node does not see it)."""
        encoded = SNAPSHOT_CODEC.encode(self.inner.snapshot())

        def save(into: str) -> None:
            with open(os.path.join(into, SNAPSHOT_FILE), "wb") as f:
                f.write(encoded)

        await asyncio.to_thread(write_part, writer, directory, save)  # off the loop: it may wait on the writer

    async def restore(self, directory: str, held_sample_ids: set[str], delivered_version: int,
                writer: WriterClient | None = None) -> int:
        """Continue from a checkpoint (its path on the run directory's node, read through its
        `writer`); returns how many prompts will be issued again."""
        def read() -> bytes:
            with local_copy(writer, directory, [SNAPSHOT_FILE]) as local, open(os.path.join(local, SNAPSHOT_FILE), "rb") as f:
                return f.read()

        self.inner.restore(SNAPSHOT_CODEC.decode(await asyncio.to_thread(read)), held_sample_ids, delivered_version)
        self.restored = True
        return len(self.inner.reissue)

    def sample_states(self, sample_ids: list[str]) -> dict[str, str | None]:
        return {sid: self.inner.ledger.state(sid) for sid in sample_ids}

    def ledger(self) -> dict:
        return {"counts": self.inner.ledger.state_counts(), "problems": self.inner.ledger.check(),
                "trained_ids": self.inner.ledger.trained_ids()}

    def open_samples(self) -> dict[str, list[str]]:
        """The ids of the samples in flight and awaiting their reward (a drained run's check)."""
        return {state.value: self.inner.ledger.open_ids(state)
                for state in (SampleState.IN_FLIGHT, SampleState.AWAITING_REWARD)}
