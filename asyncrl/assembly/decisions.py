"""The seam between the assembly strategies and the assembler: what a strategy decides, and nothing else.

A strategy is told of new rows and newly scored samples and answers with a `Decision`: which
samples are kept (awaiting training), which end here and why, the batches ready to leave, the
finished responses the critic learns from, the values each kept sample was valued with (for the
store), and its own counters. The assembler alone acts on it: the ledger, the counters, the store,
the staleness mask (once, as a batch leaves) and the batches. A strategy has no way to touch the
books, so a new one cannot leave them unbalanced.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from asyncrl.assembly.rows import Outcome
from asyncrl.messages.structs import DropReason, Reward, ScoredTrajectory, Segment, TrainingRow


@dataclass(frozen=True)
class Scored:
    """A finished sample (all windows merged) and its reward, as every strategy sees it."""

    sample: Segment
    reward: Reward
    score: float  # the endpoint's score plus the overlong penalty: shaped once, by the assembler

    @property
    def penalty(self) -> float:
        """The overlong penalty alone (a reward term: its advantage adds to the judge's)."""
        return self.score - self.reward.score

    @property
    def outcome(self) -> Outcome:
        return Outcome(self.score, self.reward.correct, self.reward.token_rewards, self.reward.failed)


@dataclass
class ReadyBatch:
    """A batch a strategy formed: its rows, its stats, and for an empty one why the step is skipped."""

    rows: list[TrainingRow]
    stats: dict[str, float]
    skip_reason: str = ""


@dataclass
class Decision:
    kept: list[str] = field(default_factory=list)  # samples now awaiting training
    dropped: list[tuple[list[str], DropReason]] = field(default_factory=list)  # samples that end here
    dropped_rows: list[tuple[Segment, DropReason]] = field(default_factory=list)  # rows (a finished one ends its sample)
    recorded: list[str] = field(default_factory=list)  # mode=generate: scored and stored, never trained
    batches: list[ReadyBatch] = field(default_factory=list)
    trajectories: list[ScoredTrajectory] = field(default_factory=list)  # for the value learner
    values: dict[str, np.ndarray | None] = field(default_factory=dict)  # sample id -> its values (the store)
    counters: collections.Counter = field(default_factory=collections.Counter)

    def keep(self, sample_ids: list[str]) -> None:
        self.kept += sample_ids

    def drop(self, sample_ids: list[str], reason: DropReason) -> None:
        self.dropped.append((list(sample_ids), reason))

    def drop_row(self, row: Segment, reason: DropReason) -> None:
        self.dropped_rows.append((row, reason))


class AssemblyStrategy(Protocol):
    """How samples become batches for one kind of advantage (`asyncrl.assembly.strategies.STRATEGIES`)."""

    needs_value_learner: ClassVar[bool]  # the run starts a value learner for it
    row_kind: str  # which segments the assembler passes as rows: none | windows (T-PPO) | responses

    async def decide(self, rows: list[Segment], scored: list[Scored]) -> Decision: ...

    def finish_batch(self, rows: list[TrainingRow]) -> tuple[list[TrainingRow], dict[str, float]]:
        """A batch's rows once the assembler masked stale tokens: the last transform (whitening) and
        the stats that depend on which rows stayed."""

    def stats(self) -> dict: ...
