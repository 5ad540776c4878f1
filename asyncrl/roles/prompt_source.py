"""Prompt source: walks the dataset (an epoch cursor over a seeded shuffle) and feeds the
generators' prompt mailbox.

It holds the admission side of the staleness bound (`asyncrl.staleness.admission_budget`): a
prompt is issued only while the budget allows, so generators never run more than
`max_staleness_versions` learner steps ahead of training, and dropped work (dynamic sampling, stale
rows, value warm-up) is replaced. The assembler's staleness check is the other side.

It keeps the ledger of samples (`asyncrl.ledger`): it admits every sample it issues, and the
assembler and the learner report how each one moves on and ends. On resume, the prompts whose
samples were open at the checkpoint (and not in a saved batch) are issued again first, with
their ids and seeds, outside the budget they were already counted in.
"""

from __future__ import annotations

import asyncio
import collections
import random

import msgspec
import numpy as np

from asyncrl.algo.selection import curriculum_sources
from asyncrl.ledger import LedgerSnapshot, SampleLedger
from asyncrl.mailbox import Mailbox
from asyncrl.schema import Codec, PromptRequest
from asyncrl.staleness import admission_budget
from asyncrl.tasks import Example


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


SNAPSHOT_CODEC = Codec(CursorSnapshot)


class PromptSource:
    def __init__(self, examples: list[Example], prompt_token_ids: list[list[int]], group_size: int,
                 out: Mailbox, seed: int = 0, prompts_per_step: int = 1, max_staleness_versions: int = 1 << 30,
                 curriculum: list[tuple[int, list[str]]] | None = None, max_prompts: int = 0):
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
        self.learner_version = 0
        self.dropped_prompts = 0.0
        self._budget_changed = asyncio.Event()
        self.ledger = SampleLedger()
        self.reissue: collections.deque[PromptRequest] = collections.deque()
        self.examples_replaced = False
        self.max_prompts = max_prompts  # 0 = unbounded (mode=generate issues a fixed number)

    @property
    def budget(self) -> int:
        return admission_budget(self.learner_version, self.max_staleness_versions, self.prompts_per_step,
                                self.dropped_prompts)

    def set_learner_version(self, version: int) -> None:
        self.learner_version = max(self.learner_version, version)
        self._budget_changed.set()

    def record(self, sample_ids: list[str], state: str, reason: str = "") -> None:
        """The ledger event of the assembler or the learner; a drop returns its share of a prompt
        to the admission budget."""
        moved = self.ledger.advance(sample_ids, state, reason)
        if state == "dropped" and moved:
            self.dropped_prompts += moved / self.group_size
            self._budget_changed.set()

    def set_examples(self, examples: list[Example], prompt_token_ids: list[list[int]]) -> None:
        """Replace the prompt set before the first issue (Pre-PPO selection)."""
        if self.issued:
            raise RuntimeError("the prompt set can only change before the first prompt is issued")
        if not examples:
            raise ValueError("the prompt selection is empty")
        self.examples, self.prompt_token_ids = examples, prompt_token_ids
        self.examples_replaced = True
        self.epoch, self.index = 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next_request(self) -> PromptRequest:
        allowed = curriculum_sources(self.learner_version, self.curriculum)
        while True:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            example = self.examples[self._order[self.index]]
            if allowed is None or example.data_source in allowed:
                break
            # Not in this curriculum stage: it comes back next epoch (stages are validated non-empty).
            self.index += 1
            self.skipped_by_curriculum += 1
        tokens = self.prompt_token_ids[self._order[self.index]]
        self.index += 1
        self.issued += 1
        # The prompt id is unique per issue (a prompt recurs every epoch); seeds follow it.
        request = PromptRequest(
            prompt_id=f"{example.prompt_id}@{self.epoch}",
            prompt_token_ids=np.asarray(tokens, dtype=np.int32),
            group_size=self.group_size,
            data_source=example.data_source,
            ground_truth=example.ground_truth,
            prompt_text=example.text,
            seed=(self.seed * 1_000_003 + self.issued) * 1024,
        )
        self.ledger.admit(request)
        return request

    async def run(self) -> None:
        self._running = True
        while self._running:
            if self.reissue:
                await self.out.put([self.reissue[0]])
                self.reissue.popleft()
                continue
            if self.issued >= self.budget or (self.max_prompts and self.issued >= self.max_prompts):
                self._budget_changed.clear()
                try:
                    await asyncio.wait_for(self._budget_changed.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass
                continue
            await self.out.put([self.next_request()])

    def stop(self) -> None:
        self._running = False

    def stats(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "issued": self.issued, "budget": self.budget,
                "learner_version": self.learner_version, "dropped_prompts": self.dropped_prompts,
                "skipped_by_curriculum": self.skipped_by_curriculum, "prompts": len(self.examples),
                "reissue_pending": len(self.reissue), "max_prompts": self.max_prompts,
                "ledger": self.ledger.state_counts(),
                "ledger_problems": self.ledger.check()}

    # --- checkpoint and resume -------------------------------------------------------------------

    def snapshot(self) -> CursorSnapshot:
        replaced = self.examples_replaced
        return CursorSnapshot(
            epoch=self.epoch, index=self.index, issued=self.issued, dropped_prompts=self.dropped_prompts,
            skipped_by_curriculum=self.skipped_by_curriculum, ledger=self.ledger.snapshot(),
            examples=[{"prompt_id": e.prompt_id, "messages": e.messages, "ground_truth": e.ground_truth,
                       "data_source": e.data_source} for e in self.examples] if replaced else None,
            prompt_token_ids=[list(map(int, t)) for t in self.prompt_token_ids] if replaced else None,
        )

    def restore(self, snap: CursorSnapshot, held_sample_ids: set[str], learner_version: int) -> None:
        """Continue from a checkpoint: cursor, budget, ledger; queue the prompts to issue again."""
        if snap.examples is not None:
            self.examples = [Example(**e) for e in snap.examples]
            self.prompt_token_ids = snap.prompt_token_ids
            self.examples_replaced = True
        self.epoch, self.index, self.issued = snap.epoch, snap.index, snap.issued
        self._order = self._shuffle(self.epoch)
        self.dropped_prompts, self.skipped_by_curriculum = snap.dropped_prompts, snap.skipped_by_curriculum
        self.learner_version = learner_version
        self.ledger, reissue = SampleLedger.restore(snap.ledger, held_sample_ids)
        self.reissue = collections.deque(reissue)
