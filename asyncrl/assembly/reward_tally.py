"""What the rewards of a run say, as the assembler reports them: the counters over every sample
scored, and the reward and accuracy of everything generated since the last batch.

The batch's own reward is biased by dynamic sampling (kept groups are mixed); the reward of every
sample scored since the previous batch, dropped groups included, is the policy's reward, and it
travels with the next batch's stats (`reward_mean_generated`, `accuracy_generated`, the share with
a sign of reward hacking, and the other numbers a reward function returns, per data source, as
verl logs them).
"""

from __future__ import annotations

import collections

from asyncrl.messages.structs import Reward
from asyncrl.redaction import masked


class RewardTally:
    def __init__(self):
        self.counters: collections.Counter = collections.Counter()
        self.rewards_sum = 0.0
        self.last_failure = ""  # why the last failed reward failed (keys masked)
        self._since_batch = [0.0, 0, 0, 0]  # score sum, correct count, samples, suspicious
        self._last_generated = {"reward_mean_generated": 0.0, "accuracy_generated": 0.0,
                                "reward_suspicious_share_generated": 0.0}
        # (data source, name) -> [sum, count] since the last batch.
        self._extra_since_batch: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
        self._last_extra: dict[str, float] = {}

    def add(self, reward: Reward, data_source: str = "") -> None:
        self.counters["samples_scored"] += 1
        self.counters["reward_failures"] += int(reward.failed)
        if reward.failed:  # the counter says how many, this says why
            self.last_failure = masked(reward.details.get("error", ""))[:300]
        self.counters[f"rewards_by_version.{reward.source_version or reward.source}"] += 1
        for conduct in reward.suspicious:  # reward hacking, by kind
            self.counters[f"suspicious.{conduct}"] += 1
        self.counters["rewards_suspicious"] += int(bool(reward.suspicious))
        for name, value in (reward.details.get("extra") or {}).items():
            cell = self._extra_since_batch[data_source, name]
            cell[0] += value
            cell[1] += 1
        self.rewards_sum += reward.score
        self._since_batch[0] += reward.score
        self._since_batch[1] += int(bool(reward.correct))
        self._since_batch[2] += 1
        self._since_batch[3] += int(bool(reward.suspicious))

    def generated_stats(self) -> dict[str, float]:
        """Since the previous batch; when no sample was scored since (two batches emitted back to
        back), the previous figures stand rather than a false 0."""
        total, correct, n, suspicious = self._since_batch
        if n:
            self._last_generated = {"reward_mean_generated": total / n, "accuracy_generated": correct / n,
                                    "reward_suspicious_share_generated": suspicious / n}
            self._last_extra = {f"reward_extra/{source}/{name}": s / k
                                for (source, name), (s, k) in self._extra_since_batch.items()}
        return {**self._last_generated, **self._last_extra}

    def batch_sent(self) -> None:
        """A batch left with `generated_stats()`: the next one counts from here."""
        self._since_batch = [0.0, 0, 0, 0]
        self._extra_since_batch.clear()

    def stats(self) -> dict:
        scored = self.counters["samples_scored"]
        return {**self.counters, "reward_mean_all": self.rewards_sum / scored if scored else 0.0,
                "last_reward_failure": self.last_failure}
