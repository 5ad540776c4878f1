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
`retire_after_groups` groups had no signal (all correct, or all wrong) is retired: skipped until
`retire_epochs` datasets' worth of other prompts have been issued, then tried again; one group with
signal brings it back. The wait is counted in prompts issued, not cursor passes. When every prompt
is retired, those not solved (all wrong) are tried once more at once (nothing else can be issued,
and the policy has changed since). When that too gave no signal, nothing is left to learn: nothing
is generated for nothing and the status says so (`asyncrl train` stops there; a Serve run keeps
serving the policy and tries the prompt retired longest again every `retest_every_s`, so a swapped
reward or a changed policy brings prompts back). On resume, the prompts whose
samples were open at the checkpoint (and not in a saved batch) are issued again first, with
their ids and seeds, outside the budget they were already counted in.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
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
    # Retired prompts (example id -> reason, until issued, since, times, issue number) and recent verdicts.
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
    until_issued: int  # skipped until the prompt source has issued this many prompts
    since_step: int  # the learner version when it was retired
    times: int = 1  # retired again after a re-test without signal
    issue_no: int = 0  # the issue of the group that retired it: older groups cannot bring it back


class PromptSource:
    def __init__(self, examples: list[Example], prompt_token_ids: list[list[int]], group_size: int,
                 out: Mailbox, seed: int = 0, prompts_per_step: int = 1, max_staleness_versions: int = 1 << 30,
                 curriculum: list[tuple[int, list[str]]] | None = None, max_prompts: int = 0,
                 retire_after_groups: int = 0, retire_epochs: int = 1, retire_unsolved: bool = True,
                 filter_metric: str = "acc", retest_every_s: float = 30.0):
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
        self.retest_every_s, self._last_retest = retest_every_s, time.monotonic()
        self._groups: collections.OrderedDict[str, dict[int, Outcome]] = collections.OrderedDict()
        self._verdicts: dict[str, collections.deque] = {}  # example id -> its recent groups' verdicts
        self.retired: dict[str, Retirement] = {}  # example id -> why and until when
        self._issue_no: dict[str, int] = {}  # open prompt id -> its issue number (ordering verdicts)
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
        issue_no = self._issue_no.pop(prompt_id, self.issued)
        self._judge(prompt_id.rpartition("@")[0], verdict, issue_no)

    def _judge(self, example_id: str, verdict: str | None, issue_no: int) -> None:
        if not self.retire_after_groups:
            return
        recent = self._verdicts.setdefault(example_id, collections.deque(maxlen=self.retire_after_groups))
        recent.append(verdict)
        reason = retirement_reason(list(recent), self.retire_after_groups, self.retire_unsolved)
        previous = self.retired.get(example_id)
        if reason is None:
            # A group with signal issued no earlier than the retiring one: back in the rotation (a
            # group issued before it and scored late says nothing newer).
            if previous is not None and verdict is None and issue_no >= previous.issue_no:
                del self.retired[example_id]
                self.retirement_counts["back"] += 1
                self._log(example_id, "back", previous.reason)
            return
        until = self.issued + self.retire_epochs * len(self.examples)
        if previous is None:
            self.retired[example_id] = Retirement(reason, until, self.learner_version, issue_no=issue_no)
            self.retirement_counts["retired"] += 1
            self.retirement_counts[f"retired_{reason}"] += 1
            self._log(example_id, "retired", reason, until)
        elif issue_no >= previous.issue_no:  # a re-test without signal: another wait
            previous.reason, previous.until_issued, previous.times = reason, until, previous.times + 1
            previous.issue_no = issue_no

    def _log(self, example_id: str, event: str, reason: str, until_issued: int | None = None) -> None:
        self.retirement_log.append({"seq": self.retirement_counts["retired"] + self.retirement_counts["back"],
                                    "prompt": example_id, "event": event, "reason": reason,
                                    "until_issued": until_issued, "learner_version": self.learner_version,
                                    "last_groups": self.retire_after_groups})

    def exhausted(self) -> bool:
        """Nothing left to learn from: every prompt is retired, as solved, or without a signal again
        after being tried once more (DAPO learns nothing from a group that is all wrong)."""
        return len(self.retired) == len(self.examples) and all(
            r.reason == "solved" or r.times >= 2 for r in self.retired.values())

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

    def next_request(self) -> PromptRequest | None:
        """The next prompt in the cursor's order. When every prompt allowed now is retired, the
        cursor stays where it was and the answer is None, or every `retest_every_s` the prompt
        retired longest is tried again (a swapped reward or the policy may have changed)."""
        allowed = curriculum_sources(self.learner_version, self.curriculum)
        start, retired_skips = (self.epoch, self.index, self._order), 0
        while True:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            example = self.examples[self._order[self.index]]
            retired = self.retired.get(example.prompt_id)
            if retired is not None and self.issued < retired.until_issued:
                # Retired (no signal in its last groups): tried again once enough others were issued.
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
        self.retirement_counts["skipped"] += retired_skips
        position = self._order[self.index]
        self.index += 1
        # The prompt id is unique per issue (a prompt recurs every epoch); seeds follow it.
        return self._issue(position, f"{example.prompt_id}@{self.epoch}")

    def _retest(self) -> PromptRequest | None:
        """Every prompt is retired. One retired without being solved (all wrong, no signal) is tried
        again at once: the policy has changed since, and nothing else can be issued. When all are
        solved, the one retired longest, once per `retest_every_s` (a service that keeps running)."""
        if not self.retired:
            return None
        # Not solved and not yet tried again since it was retired (a second retirement ends that).
        unsolved = [k for k, r in self.retired.items() if r.reason != "solved" and r.times < 2]
        now = time.monotonic()
        if not unsolved and now - self._last_retest < self.retest_every_s:
            return None
        self._last_retest = now
        example_id = min(unsolved or self.retired, key=lambda k: self.retired[k].until_issued)
        position = next(i for i, ex in enumerate(self.examples) if ex.prompt_id == example_id)
        self.retirement_counts["retests"] += 1
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
            prompt_text=example.text,
            seed=(self.seed * 1_000_003 + self.issued) * 1024,
        )
        self.ledger.admit(request)
        if self.retire_after_groups:
            self._issue_no[request.prompt_id] = self.issued
            while len(self._issue_no) > 4096:  # prompts whose groups never complete (work lost in a restart)
                self._issue_no.pop(next(iter(self._issue_no)))
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
            request = self.next_request()
            if request is None:  # every prompt is retired: wait for a verdict, or a new version
                self._budget_changed.clear()
                try:
                    await asyncio.wait_for(self._budget_changed.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass
                continue
            await self.out.put([request])

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
                "all_prompts_exhausted": self.exhausted(),
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
            retired={k: (r.reason, r.until_issued, r.since_step, r.times, r.issue_no) for k, r in self.retired.items()},
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
