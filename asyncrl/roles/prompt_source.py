"""Prompt source: walks the dataset (an epoch cursor over a seeded shuffle) and feeds the
generators' prompt mailbox.

It holds the admission side of the staleness bound (`asyncrl.staleness.admission_budget`): a
prompt is issued only while the budget allows, so generators never run more than
`max_staleness_versions` learner steps ahead of training, and dropped work (dynamic sampling, stale
rows, value warm-up) is replaced. The assembler's staleness check is the other side.

It keeps the ledger of samples (`asyncrl.ledger`): it admits every sample it issues, and the
assembler and the learner report how each one moves on and ends (the assembler in one call per
step for all its events).

It tracks each prompt's groups (the rewards the assembler saw): a prompt whose last
`retire_after_groups` groups had no signal (all correct, or all wrong) is retired, skipped for
`retire_epochs` epochs, then tried again; one group with signal brings it back. Retirements are
counted and logged, and when every prompt of a data source is retired the status says so. On resume, the prompts whose
samples were open at the checkpoint (and not in a saved batch) are issued again first, with
their ids and seeds, outside the budget they were already counted in.
"""

from __future__ import annotations

import asyncio
import collections
import random
from dataclasses import dataclass

import msgspec
import numpy as np

from asyncrl.algo.selection import curriculum_sources, group_verdict, retirement_reason
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
    # Retired prompts (example id -> reason, until epoch, since, times, issued epoch) and recent verdicts.
    retired: dict[str, tuple[str, int, int, int, int]] = {}
    verdicts: dict[str, list[str | None]] = {}


SNAPSHOT_CODEC = Codec(CursorSnapshot)

# A sample's outcome as the assembler saw it: (issued prompt id, sample index, correct, score, failed).
Outcome = tuple[str, int, "bool | None", float, bool]
# The assembler's ledger events: (sample ids, new state, reason of a drop).
LedgerEvent = tuple[list[str], str, str]


@dataclass
class Retirement:
    reason: str  # solved | unsolved | no_signal
    until_epoch: int  # skipped when the cursor reaches it before this epoch
    since_step: int  # the learner step when it was retired
    times: int = 1  # retired again after a re-test without signal
    issued_epoch: int = 0  # the epoch of the group that retired it: older groups cannot bring it back


class PromptSource:
    def __init__(self, examples: list[Example], prompt_token_ids: list[list[int]], group_size: int,
                 out: Mailbox, seed: int = 0, prompts_per_step: int = 1, max_staleness_versions: int = 1 << 30,
                 curriculum: list[tuple[int, list[str]]] | None = None, max_prompts: int = 0,
                 retire_after_groups: int = 0, retire_epochs: int = 1, retire_unsolved: bool = True,
                 filter_metric: str = "acc"):
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
        self.retire_after_groups, self.retire_epochs = retire_after_groups, retire_epochs
        self.retire_unsolved, self.filter_metric = retire_unsolved, filter_metric
        self._groups: collections.OrderedDict[str, dict[int, Outcome]] = collections.OrderedDict()
        self._verdicts: dict[str, collections.deque] = {}  # example id -> its recent groups' verdicts
        self.retired: dict[str, Retirement] = {}  # example id -> why and until when
        self.retirement_log: collections.deque[dict] = collections.deque(maxlen=100)
        self.retirement_counts = collections.Counter()  # retired / back / skipped / by reason

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

    def record_events(self, events: list[LedgerEvent], outcomes: list[Outcome]) -> None:
        """The assembler's events since its last call, in one call: ledger moves and samples' rewards."""
        for sample_ids, state, reason in events:
            self.record(sample_ids, state, reason)
        for outcome in outcomes:
            self._note_outcome(outcome)

    # --- retirement of saturated prompts -----------------------------------------------------------

    def _note_outcome(self, outcome: Outcome) -> None:
        prompt_id, idx = outcome[0], outcome[1]
        group = self._groups.setdefault(prompt_id, {})
        group[idx] = outcome
        while len(self._groups) > 4096:  # groups that never complete (work lost in a restart)
            self._groups.popitem(last=False)
        if len(group) < self.group_size:
            return
        del self._groups[prompt_id]
        members = [group[i] for i in sorted(group)]
        verdict = group_verdict([m[2] for m in members], [m[3] for m in members], [m[4] for m in members],
                                self.filter_metric)
        example_id, _, issued_epoch = prompt_id.rpartition("@")
        self._judge(example_id, verdict, int(issued_epoch) if issued_epoch.isdigit() else self.epoch)

    def _judge(self, example_id: str, verdict: str | None, issued_epoch: int) -> None:
        if not self.retire_after_groups:
            return
        recent = self._verdicts.setdefault(example_id, collections.deque(maxlen=self.retire_after_groups))
        recent.append(verdict)
        reason = retirement_reason(list(recent), self.retire_after_groups, self.retire_unsolved)
        previous = self.retired.get(example_id)
        if reason is None:
            # A group with signal issued no earlier than the retiring one: back in the rotation (a
            # group issued before it and scored late says nothing newer).
            if previous is not None and verdict is None and issued_epoch >= previous.issued_epoch:
                del self.retired[example_id]
                self.retirement_counts["back"] += 1
                self._log(example_id, "back", previous.reason)
            return
        until = issued_epoch + self.retire_epochs + 1
        if previous is None:
            self.retired[example_id] = Retirement(reason, until, self.learner_version, issued_epoch=issued_epoch)
            self.retirement_counts["retired"] += 1
            self.retirement_counts[f"retired_{reason}"] += 1
            self._log(example_id, "retired", reason, until)
        else:
            previous.reason, previous.until_epoch, previous.times = reason, max(previous.until_epoch, until), previous.times + 1
            previous.issued_epoch = max(previous.issued_epoch, issued_epoch)

    def _log(self, example_id: str, event: str, reason: str, until_epoch: int | None = None) -> None:
        self.retirement_log.append({"seq": self.retirement_counts["retired"] + self.retirement_counts["back"],
                                    "prompt": example_id, "event": event, "reason": reason,
                                    "until_epoch": until_epoch, "learner_version": self.learner_version,
                                    "last_groups": self.retire_after_groups})

    def retired_sources(self) -> list[str]:
        """Data sources every prompt of which is retired: nothing of them is left to learn from now."""
        by_source = collections.defaultdict(lambda: [0, 0])
        for example in self.examples:
            counts = by_source[example.data_source]
            counts[0] += 1
            counts[1] += example.prompt_id in self.retired
        return sorted(source for source, (total, retired) in by_source.items() if total and retired == total)

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
            retired = self.retired.get(example.prompt_id)
            if retired is not None and self.epoch < retired.until_epoch:
                # Retired (no signal in its last groups): it is tried again from `until_epoch` on.
                self.index += 1
                self.retirement_counts["skipped"] += 1
                continue
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
                "prompts_retired": len(self.retired), "prompts_retired_share": len(self.retired) / len(self.examples),
                "retired_by_reason": dict(collections.Counter(r.reason for r in self.retired.values())),
                "retirements": dict(self.retirement_counts), "retired_sources": self.retired_sources(),
                "retirement_log": list(self.retirement_log),
                "all_prompts_retired": len(self.retired) == len(self.examples),
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
            retired={k: (r.reason, r.until_epoch, r.since_step, r.times, r.issued_epoch) for k, r in self.retired.items()},
            verdicts={k: list(v) for k, v in self._verdicts.items()},
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
        self.retired = {k: Retirement(*v) for k, v in snap.retired.items()}
        self._verdicts = {k: collections.deque(v, maxlen=max(1, self.retire_after_groups)) for k, v in snap.verdicts.items()}
        self.ledger, reissue = SampleLedger.restore(snap.ledger, held_sample_ids)
        self.reissue = collections.deque(reissue)
