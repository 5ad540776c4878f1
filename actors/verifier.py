"""Verifier: a rule-based reward endpoint scoring finished responses (math answers, tiny task)."""

from __future__ import annotations

import msgspec

from asyncrl.schema import Reward
from asyncrl.tasks import score_response


class RewardRequest(msgspec.Struct, frozen=True, kw_only=True):
    prompt_id: str
    sample_idx: int
    response_text: str
    ground_truth: str
    data_source: str


class Verifier:
    """Scores `RewardRequest`s. Bad input becomes a failed zero reward with a reason, never a crash."""

    name = "verifier"
    version = "math-verify-1"

    def __init__(self, reward_style: str = "zero_one"):
        self.reward_style = reward_style
        self.scored = 0
        self.failed = 0

    def score(self, requests: list[RewardRequest]) -> list[Reward]:
        rewards = []
        for req in requests:
            try:
                score, correct, pred = score_response(req.data_source, req.response_text, req.ground_truth, self.reward_style)
                rewards.append(Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=score,
                                      correct=correct, source=self.name, source_version=self.version,
                                      details={"pred": pred[:200]}))
            except Exception as exc:  # a verifier bug must not lose the sample: record it as failed
                self.failed += 1
                rewards.append(Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=0.0,
                                      correct=False, source=self.name, source_version=self.version, failed=True,
                                      details={"error": f"{type(exc).__name__}: {exc}"[:500]}))
            self.scored += 1
        return rewards

    def stats(self) -> dict:
        return {"scored": self.scored, "failed": self.failed}
