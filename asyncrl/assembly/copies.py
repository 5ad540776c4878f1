"""One copy of each sample, stated once: the assembler's intake of windows (`actors.assembler`).

A sample may be generated twice: its prompt's lease ran out while a generator still worked on it
(a generator stopped for longer than a lease), or a generator left the pool (healed or drained)
and its unacknowledged prompts went to another, which regenerates them from their first window.
Both copies reach the assembler (a segment's id names its generator, so the mailbox lets both
through). The invariant: windows are merged per generator (a copy's windows arrive in order from
its first, or are not taken), the first copy to finish is the sample, the others are discarded
then, and any later window of a finished sample is ignored, whoever sends it. A generator that left
still has its windows taken: what it finished counts, and its partial copies wait for another copy
to finish. With windows trained as they arrive (T-PPO), one copy's windows are rows: the first to
start, or, once its generator left, the next copy that starts (plus the window that finishes the
sample, whichever copy it is from).
"""

from __future__ import annotations

import collections

import msgspec

from asyncrl.messages.mailbox import RecentIds
from asyncrl.messages.routes import joined_routes
from asyncrl.messages.structs import Segment


class SampleCopies:
    def __init__(self, window: int = 200_000):
        # sample id -> generator id -> that generator's windows of it so far (its copy)
        self._copies: dict[str, dict[str, list[Segment]]] = collections.defaultdict(dict)
        self._row_copy: dict[str, str] = {}  # sample id -> the generator whose windows are rows
        self._seen = RecentIds(window)  # window ids (per generator) taken
        self._finished = RecentIds(window)  # samples merged: later windows of them are ignored
        self.retired: set[str] = set()  # generators that left the pool
        self.counters = collections.Counter()

    def __len__(self) -> int:
        """Samples with a partial copy."""
        return len(self._copies)

    def add(self, seg: Segment) -> tuple[bool, list[Segment] | None]:
        """Take `seg`: (whether it was taken, the windows of the copy it finishes, or None)."""
        if seg.msg_id in self._seen:
            self.counters["duplicate_segments"] += 1
            return False, None
        if seg.sample_id in self._finished:
            self.counters["segments_ignored"] += 1  # another copy of this sample finished first
            return False, None
        copies = self._copies[seg.sample_id]
        parts = copies.get(seg.generator_id, [])
        if seg.window != len(parts):  # a copy's windows arrive in order from window 0, or not at all
            self.counters["segments_out_of_order"] += 1
            if not copies:
                del self._copies[seg.sample_id]
            return False, None
        self._seen.add(seg.msg_id)
        self.counters["segments"] += 1
        copies[seg.generator_id] = parts + [seg]
        if not seg.finished:
            return True, None
        del self._copies[seg.sample_id]
        self.counters["copies_discarded"] += len(copies) - 1
        self._row_copy.pop(seg.sample_id, None)
        self._finished.add(seg.sample_id)
        return True, copies[seg.generator_id]

    def is_row(self, seg: Segment) -> bool:
        """Windows as rows: whether `seg` (just taken) trains."""
        owner = self._row_copy.get(seg.sample_id)
        if owner is None or (owner in self.retired and owner != seg.generator_id and seg.window == 0):
            self._row_copy[seg.sample_id] = owner = seg.generator_id
        if seg.finished:
            return True
        return owner == seg.generator_id

    def with_prior_routes(self, seg: Segment, parts: list[Segment] | None = None) -> Segment:
        """A window row (just taken) with the routes of its copy's earlier windows, its context's
        generated tokens (`parts`: the copy's windows when `seg` finished it). A copy whose earlier
        windows are not all here leaves the row as it is: the learner routes that context itself."""
        if seg.new_routes is None or seg.prior_routes is not None or seg.window == 0:
            return seg
        earlier = [p for p in (parts or self._copies.get(seg.sample_id, {}).get(seg.generator_id, []))
                   if p.window < seg.window]
        if len(earlier) != seg.window:
            return seg
        return msgspec.structs.replace(seg, prior_routes=joined_routes(
            [(p.new_routes, len(p.new_token_ids)) for p in earlier]))

    def retire(self, generator_id: str) -> int:
        """A generator left the pool: nothing of it is dropped. Returns how many partial copies it leaves."""
        self.retired.add(generator_id)
        return sum(generator_id in copies for copies in self._copies.values())
