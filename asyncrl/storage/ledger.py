r"""The ledger of samples: where every admitted prompt sample is, from admission to its end.

A sample is admitted when its prompt is issued and is then in exactly one state:

    in_flight -> awaiting_reward -> awaiting_training -> trained
                                                      \-> dropped (with a reason)
                                 \-> recorded (`mode=generate`: scored and stored, never trained)

Events come from different actors (generation ends in the assembler, training in the learner) and
may arrive out of order, so a state only moves forward: an event for an earlier state than the
one recorded is ignored, and a second `trained` for the same id is counted as a duplicate (the
exactly-once check). The invariant `admitted == in_flight + awaiting_reward + awaiting_training +
trained + dropped + recorded` holds after every call; `check()` says why when it does not.

Memory stays bounded on a run of days: a prompt's request is kept only while one of its samples
is open (it is what a resume re-issues), and the ids of ended samples are remembered for the
last `ended_window` only (enough to catch a duplicate, which arrives within minutes), with their
counts kept exactly.
"""

from __future__ import annotations

import collections
from typing import Iterable

import msgspec

from asyncrl.messages.structs import DropReason, PromptRequest, SampleState, sample_id

STATES = tuple(SampleState)
_RANK = {state: i for i, state in enumerate(STATES)}
FINAL = (SampleState.TRAINED, SampleState.DROPPED, SampleState.RECORDED)


class LedgerSnapshot(msgspec.Struct, kw_only=True):
    """What a checkpoint keeps of the ledger (msgspec, never pickle)."""

    open_samples: dict[str, str]  # sample id -> state (not final; a `SampleState` value)
    requests: list[PromptRequest]  # the prompts with open samples
    ended: dict[str, str]  # recent ended ids -> trained | dropped:<reason>
    counts: dict[str, int]
    dropped_by_reason: dict[str, int]


class SampleLedger:
    def __init__(self, ended_window: int = 200_000):
        self.ended_window = ended_window
        self._open: dict[str, str] = {}  # sample id -> open state
        self._requests: dict[str, PromptRequest] = {}  # prompt id -> request, while any sample is open
        self._open_per_prompt: collections.Counter[str] = collections.Counter()
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.counts = collections.Counter({"admitted": 0, "trained": 0, "dropped": 0, "recorded": 0,
                                           "duplicates": 0, "unknown_ids": 0, "readmitted": 0})
        self.dropped_by_reason: collections.Counter[str] = collections.Counter()

    # --- events --------------------------------------------------------------------------------

    def admit(self, request: PromptRequest) -> list[str]:
        """A prompt was issued: its G samples are in flight."""
        if request.prompt_id in self._requests:
            raise ValueError(f"prompt {request.prompt_id} was admitted twice")
        ids = [sample_id(request.prompt_id, i) for i in range(request.group_size)]
        for sid in ids:
            if sid in self._open or sid in self._ended:
                raise ValueError(f"sample {sid} was admitted twice")
            self._open[sid] = SampleState.IN_FLIGHT
        self._requests[request.prompt_id] = request
        self._open_per_prompt[request.prompt_id] = len(ids)
        self.counts["admitted"] += len(ids)
        return ids

    def advance(self, sample_ids: Iterable[str], state: SampleState | str,
                reason: DropReason | str | None = None) -> int:
        """Move samples forward to `state`; returns how many moved. `dropped` needs a reason."""
        try:
            state = SampleState(state)
        except ValueError:
            raise ValueError(f"state must be one of {[s.value for s in STATES[1:]]}, got {state!r}") from None
        if state is SampleState.IN_FLIGHT:
            raise ValueError("a sample enters in_flight when its prompt is admitted, not by an event")
        if state is SampleState.DROPPED and not reason:
            raise ValueError("a dropped sample needs a reason")
        reason = DropReason(reason).value if reason else ""
        moved = 0
        for sid in sample_ids:
            current = self._open.get(sid)
            if current is None:
                if sid in self._ended:
                    if state is SampleState.TRAINED and self._ended[sid] == "trained":
                        self.counts["duplicates"] += 1
                else:
                    self.counts["unknown_ids"] += 1
                continue
            if _RANK[state] <= _RANK[current]:
                continue
            moved += 1
            if state in FINAL:
                self._end(sid, f"dropped:{reason}" if state is SampleState.DROPPED else state.value)
                self.counts[state.value] += 1
                if state is SampleState.DROPPED:
                    self.dropped_by_reason[reason] += 1
            else:
                self._open[sid] = state
        return moved

    def _end(self, sid: str, how: str) -> None:
        del self._open[sid]
        self._ended[sid] = how
        while len(self._ended) > self.ended_window:
            self._ended.popitem(last=False)
        prompt_id = sid.rsplit("/", 1)[0]
        self._open_per_prompt[prompt_id] -= 1
        if self._open_per_prompt[prompt_id] <= 0:
            del self._open_per_prompt[prompt_id]
            self._requests.pop(prompt_id, None)

    # --- queries ---------------------------------------------------------------------------------

    def state(self, sid: str) -> str | None:
        if sid in self._open:
            return self._open[sid].value
        how = self._ended.get(sid)
        return None if how is None else how.split(":", 1)[0]

    def state_counts(self) -> dict[str, int]:
        open_counts = collections.Counter(self._open.values())
        return {"admitted": self.counts["admitted"],
                **{state.value: open_counts.get(state, 0) for state in STATES[:3]},
                "trained": self.counts["trained"], "dropped": self.counts["dropped"],
                "recorded": self.counts["recorded"],
                "dropped_by_reason": dict(self.dropped_by_reason),
                "duplicates": self.counts["duplicates"], "unknown_ids": self.counts["unknown_ids"],
                "readmitted": self.counts["readmitted"]}

    def check(self) -> list[str]:
        """The invariant, as a list of violations (empty when the books balance)."""
        c = self.state_counts()
        problems = []
        total = sum(c[s.value] for s in STATES)
        if total != c["admitted"]:
            problems.append(f"admitted {c['admitted']} != in_flight + awaiting + trained + dropped + recorded = {total}")
        if c["duplicates"]:
            problems.append(f"{c['duplicates']} sample(s) trained twice")
        if c["unknown_ids"]:
            problems.append(f"{c['unknown_ids']} event(s) for samples never admitted")
        if sum(self.dropped_by_reason.values()) != c["dropped"]:
            problems.append("dropped samples without a reason")
        return problems

    def open_ids(self, state: SampleState | str) -> list[str]:
        """Ids of the open samples in `state` (in_flight, awaiting_reward, awaiting_training)."""
        state = SampleState(state)
        return sorted(sid for sid, current in self._open.items() if current is state)

    def trained_ids(self) -> list[str]:
        """Ids of trained samples (the last `ended_window` ended ones)."""
        return [sid for sid, how in self._ended.items() if how == "trained"]

    # --- checkpoint and resume -----------------------------------------------------------------------

    def snapshot(self) -> LedgerSnapshot:
        return LedgerSnapshot(open_samples={sid: state.value for sid, state in self._open.items()},
                              requests=list(self._requests.values()),
                              ended=dict(self._ended), counts=dict(self.counts),
                              dropped_by_reason=dict(self.dropped_by_reason))

    @classmethod
    def restore(cls, snap: LedgerSnapshot, held: set[str], ended_window: int = 200_000
                ) -> tuple["SampleLedger", list[PromptRequest]]:
        """The ledger of a resumed run, and the prompts to issue again.

        `held`: ids of samples in the batches saved with the checkpoint (they resume as awaiting
        training). Every other open sample lost its work with the old actors (a generator's
        sequences, the assembler's partial groups) and is regenerated: its prompt is re-issued with
        the same id and seeds, for exactly those samples.
        """
        ledger = cls(ended_window)
        ledger.counts.update(snap.counts)
        ledger.dropped_by_reason.update(snap.dropped_by_reason)
        ledger._ended.update(snap.ended)
        ledger._requests = {r.prompt_id: r for r in snap.requests}
        again: dict[str, list[int]] = collections.defaultdict(list)
        for sid, state in snap.open_samples.items():
            prompt_id, idx = sid.rsplit("/", 1)
            ledger._open_per_prompt[prompt_id] += 1
            if sid in held:
                ledger._open[sid] = SampleState.AWAITING_TRAINING
            else:
                ledger._open[sid] = SampleState.IN_FLIGHT
                again[prompt_id].append(int(idx))
                ledger.counts["readmitted"] += 1
        reissue = []
        for prompt_id, indices in again.items():
            request = ledger._requests[prompt_id]
            if len(indices) < request.group_size:
                request = msgspec.structs.replace(request, sample_indices=tuple(sorted(indices)))
            reissue.append(request)
        return ledger, reissue
