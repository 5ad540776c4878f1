"""Retirement of prompts with no learning signal: the prompt source's record of each prompt's recent
groups, which prompts sit out and until when, and the log of it (`retirements.jsonl`).

A group's outcome (all correct / all wrong / mixed) comes from the rewards the assembler saw; a
prompt whose last `after_groups` groups had no signal is retired for a while. The rules are the
pure functions of `asyncrl.algo.selection`.

* **Solved** (all correct): sits out until `epochs` datasets' worth of other prompts were issued,
  then comes back (and is retired again while it stays solved).
* **Unsolved** (all wrong, or equal scores; with `unsolved`): the prompt the policy cannot do
  today is the one it should learn next, and the policy keeps moving, so it comes back as the
  policy moves: after `retry_versions` policy versions, then twice as many after each retry that is
  all wrong again (the wait doubles, up to 4 times the first). After `max_retries` such retries it
  is given up for good, counted apart (`given_up`). When nothing else can be issued (every prompt sits out) the one due
  soonest is retried at once, and that retry counts too: a policy that no longer moves gives a
  hard prompt its remaining retries at once, then the run ends.

One group with signal brings a prompt back at once. The run is done (`exhausted`) only when every
prompt is solved or given up: never while a prompt it could still learn is parked.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from asyncrl.algo.selection import group_outcome, retirement_reason

MAX_DOUBLINGS = 2  # an unsolved prompt's wait grows to at most 2**2 = 4 times `retry_versions`
# A scored sample as the prompt source judges its prompt by it: (issued prompt id, sample index,
# correct, score, failed).
SampleOutcome = tuple[str, int, "bool | None", float, bool]


@dataclass
class Retirement:
    reason: str  # solved | unsolved | no_signal
    until_issued: int  # solved: skipped until the prompt source has issued this many prompts
    since_version: int  # the delivered version when it was retired
    times: int = 1  # retired again after a re-test without signal
    issue_no: int = 0  # the issue of the group that retired it: older groups cannot bring it back
    until_version: int = 0  # unsolved: skipped until the delivered version reaches this
    given_up: bool = False  # unsolved after `max_retries` retries: retired for good
    retrying: bool = False  # unsolved: a retry is out, its outcome not in (one retry at a time)

    @property
    def solved(self) -> bool:
        return self.reason == "solved"


class Retirements:
    def __init__(self, group_size: int, after_groups: int = 0, epochs: int = 1, unsolved: bool = True,
                 filter_metric: str = "acc", retry_versions: int = 2, max_retries: int = 64):
        self.group_size = group_size
        self.after_groups, self.epochs, self.unsolved, self.filter_metric = after_groups, epochs, unsolved, filter_metric
        self.retry_versions, self.max_retries = retry_versions, max_retries
        self._groups: collections.OrderedDict[str, dict[int, SampleOutcome]] = collections.OrderedDict()
        self.outcomes: dict[str, collections.deque] = {}  # example id -> its recent groups' outcomes
        self.retired: dict[str, Retirement] = {}  # example id -> why and until when
        self.issue_no: dict[str, int] = {}  # open prompt id -> its issue number (ordering outcomes)
        self.log: collections.deque[dict] = collections.deque(maxlen=100)
        self.logged = 0  # events ever logged (the next one's sequence number)
        self.counts = collections.Counter()  # retired / back / skipped / retests / by reason

    @property
    def enabled(self) -> bool:
        return self.after_groups > 0

    def issued(self, prompt_id: str, issue_no: int) -> None:
        if self.enabled:
            self.issue_no[prompt_id] = issue_no
            while len(self.issue_no) > 4096:  # prompts whose groups never complete (work lost in a restart)
                self.issue_no.pop(next(iter(self.issue_no)))
            retired = self.retired.get(prompt_id.rpartition("@")[0])
            if retired is not None and not retired.solved:
                # One retry out at a time: two at the same version would spend two retries on one look.
                retired.retrying = True

    def note_outcome(self, outcome: SampleOutcome, issued: int, examples: int, delivered_version: int) -> None:
        """One sample's reward; when its group is complete, judge the prompt."""
        prompt_id, idx = outcome[0], outcome[1]
        group = self._groups.setdefault(prompt_id, {})
        group[idx] = outcome
        while len(self._groups) > 4096:  # groups that never complete (work lost in a restart)
            self._groups.popitem(last=False)
        if len(group) < self.group_size:
            return
        del self._groups[prompt_id]
        members = [group[i] for i in sorted(group)]
        outcome = group_outcome([m[2] for m in members], [m[3] for m in members], [m[4] for m in members],
                                self.filter_metric)
        issue_no = self.issue_no.pop(prompt_id, issued)
        self._judge(prompt_id.rpartition("@")[0], outcome, issue_no, issued + self.epochs * examples, delivered_version)

    def _judge(self, example_id: str, outcome: str | None, issue_no: int, until: int, delivered_version: int) -> None:
        if not self.enabled:
            return
        recent = self.outcomes.setdefault(example_id, collections.deque(maxlen=self.after_groups))
        recent.append(outcome)
        reason = retirement_reason(list(recent), self.after_groups, self.unsolved)
        previous = self.retired.get(example_id)
        if previous is not None:
            previous.retrying = False
        if reason is None:
            # A group with signal issued no earlier than the retiring one: back in the rotation (a
            # group issued before it and scored late says nothing newer).
            if previous is not None and outcome is None and issue_no >= previous.issue_no:
                del self.retired[example_id]
                self.counts["back"] += 1
                self._log(example_id, "back", previous.reason, delivered_version)
            return
        if previous is None:
            retired = self.retired[example_id] = Retirement(reason, until, delivered_version, issue_no=issue_no)
            retired.until_version = delivered_version + self.retry_versions
            self.counts["retired"] += 1
            self.counts[f"retired_{reason}"] += 1
            self._log(example_id, "retired", reason, delivered_version, until, retired)
        elif issue_no >= previous.issue_no and not previous.given_up:  # a re-test without signal: another wait
            previous.reason, previous.until_issued, previous.times = reason, until, previous.times + 1
            previous.issue_no = issue_no
            if previous.solved:
                return
            retries = previous.times - 1
            if self.max_retries and retries >= self.max_retries:
                previous.given_up = True
                self.counts["given_up"] += 1
                self._log(example_id, "given_up", reason, delivered_version, None, previous)
            else:  # the wait doubles with each retry all wrong again, up to 4 times the first
                previous.until_version = delivered_version + self.retry_versions * 2 ** min(retries, MAX_DOUBLINGS)
                self._log(example_id, "retried", reason, delivered_version, None, previous)

    def _log(self, example_id: str, event: str, reason: str, delivered_version: int,
             until_issued: int | None = None, retired: Retirement | None = None) -> None:
        entry = {"seq": self.logged, "prompt": example_id, "event": event, "reason": reason,
                 "until_issued": until_issued, "delivered_version": delivered_version, "last_groups": self.after_groups}
        if retired is not None and not retired.solved:
            entry.update(retries=retired.times - 1, until_version=None if retired.given_up else retired.until_version)
        self.logged += 1
        self.log.append(entry)

    def sits_out(self, example_id: str, issued: int, delivered_version: int) -> bool:
        retired = self.retired.get(example_id)
        if retired is None:
            return False
        if retired.solved:
            return issued < retired.until_issued
        return retired.given_up or retired.retrying or delivered_version < retired.until_version

    def exhausted(self, examples: int) -> bool:
        """Nothing left to learn from: every prompt is retired, as solved or given up (all wrong
        again through `max_retries` retries; DAPO learns nothing from a group that is all wrong)."""
        return len(self.retired) == examples and all(r.solved or r.given_up for r in self.retired.values())

    def to_retest(self, may_retest_solved: bool) -> str | None:
        """Every prompt sits out: the one to try again now. An unsolved one not given up, the one due
        soonest (the retry counts); else, when `may_retest_solved` (a service that keeps running),
        the one retired longest (solved or given up: a swapped reward or a changed policy brings
        it back). None: nothing now."""
        if not self.retired:
            return None
        parked = [k for k, r in self.retired.items() if not r.solved and not r.given_up]
        ready = [k for k in parked if not self.retired[k].retrying]
        if ready:
            self.counts["retests"] += 1
            return min(ready, key=lambda k: self.retired[k].until_version)
        if parked or not may_retest_solved:  # a retry is out: its outcome first
            return None
        self.counts["retests"] += 1
        return min(self.retired, key=lambda k: (self.retired[k].until_issued, self.retired[k].until_version))

    def stats(self, examples: int, by_source: dict[str, list[str]]) -> dict:
        reasons = collections.Counter("given_up" if r.given_up else r.reason for r in self.retired.values())
        return {"prompts_retired": len(self.retired), "prompts_retired_share": len(self.retired) / examples,
                # solved / parked (unsolved, no_signal: they come back as the policy moves) / given_up
                "retired_by_reason": dict(reasons), "prompts_given_up": reasons.get("given_up", 0),
                "prompts_parked": sum(n for why, n in reasons.items() if why not in ("solved", "given_up")),
                "retirements": dict(self.counts),
                "retired_sources": sorted(s for s, ids in by_source.items() if ids and all(i in self.retired for i in ids)),
                "retirement_log": list(self.log), "all_prompts_retired": len(self.retired) == examples,
                "all_prompts_exhausted": self.exhausted(examples)}

    def snapshot(self) -> tuple[dict, dict]:
        return ({k: [r.reason, r.until_issued, r.since_version, r.times, r.issue_no, r.until_version, int(r.given_up)]
                 for k, r in self.retired.items()}, {k: list(v) for k, v in self.outcomes.items()})

    def restore(self, retired: dict, outcomes: dict) -> None:
        # A checkpoint from before version-based retries has five fields: the rest take their defaults.
        self.retired = {k: Retirement(*v[:6], given_up=bool(v[6]) if len(v) > 6 else False) for k, v in retired.items()}
        self.outcomes = {k: collections.deque(v, maxlen=max(1, self.after_groups)) for k, v in outcomes.items()}
