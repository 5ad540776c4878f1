"""Verifier: the rule-based reward endpoint (math answers, code in the sandbox, format, tiny tasks).

Bad input never crashes it: an empty, huge or undecodable response, a malformed ground truth or a
verifier bug becomes a failed zero reward with the reason in `details`. A request whose data
source has no ground truth is marked not applicable, so a hybrid route falls through to a judge.
A stopped call (`asyncrl.rewards.calls`) scores no further sample: its math worker or sandbox is
killed, the samples scored keep their rewards and the others fail with the reason.

It also judges pairs (`compare`, Pairwise PPO's judge with `algorithm.advantage.endpoint` naming it):
both responses checked by the same rule, the higher score wins, equal scores tie; a pair whose
check could not be made has no verdict.

`failed` is how every scorer records a failure: its text masked (`asyncrl.redaction`).
"""

from __future__ import annotations

from asyncrl.config import VerifierEndpoint
from asyncrl.messages.structs import PairRequest, Reward, RewardRequest, ground_truth_text, has_ground_truth
from asyncrl.redaction import masked
from asyncrl.rewards.calls import CallStopped, current_call
from asyncrl.rewards.math import score_from_correct
from asyncrl.rewards.sandbox import SandboxLimits
from asyncrl.rewards.verifiers import EPISODE_TRUTH, Check, episode_truth, kind_for, verify


def not_applicable(req: RewardRequest, source: str, version: str, why: str) -> Reward:
    return Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=0.0, correct=None, source=source,
                  source_version=version, failed=True, details={"not_applicable": True, "error": masked(why)})


def failure_reason(exc: BaseException | str) -> str:
    """What a failed reward or verdict records: the text, masked and cut to 500 characters."""
    reason = exc if isinstance(exc, str) else str(exc) if isinstance(exc, CallStopped) else f"{type(exc).__name__}: {exc}"
    return masked(reason)[:500]


def failed(req: RewardRequest, source: str, version: str, exc: BaseException | str) -> Reward:
    return Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=0.0, correct=False, source=source,
                  source_version=version, failed=True, details={"error": failure_reason(exc)})


class Verifier:
    """Scores `RewardRequest`s with the verifier its data source maps to."""

    name = "verifier"

    def __init__(self, endpoint: VerifierEndpoint | None = None, default_style: str = "zero_one"):
        """`endpoint`: its section; `default_style`: task.reward, the style where the section leaves it empty."""
        self.endpoint = endpoint or VerifierEndpoint()
        self.default_style = default_style
        self.scored = 0
        self.failed = 0
        self.pairs = 0
        self.failed_pairs = 0

    @property
    def version(self) -> str:
        return self.endpoint.version

    def reconfigure(self, endpoint: VerifierEndpoint) -> bool:
        """Takes every change in place (a verifier holds no model)."""
        self.endpoint = endpoint
        return True

    def _limits(self) -> SandboxLimits:
        e = self.endpoint
        return SandboxLimits(wall_s=e.code_wall_s, cpu_s=int(e.code_wall_s) + 2, memory_mb=e.code_memory_mb,
                             isolation=e.code_isolation, allow_unisolated=e.code_allow_unisolated,
                             allow_no_cgroup=e.code_allow_no_cgroup)

    def _kind(self, data_source: str) -> str:
        return self.endpoint.verifier_kinds.get(data_source) or kind_for(data_source)

    def score(self, requests: list[RewardRequest]) -> list[Reward]:
        rewards = []
        e = self.endpoint
        limits = self._limits()
        style = e.style or self.default_style
        call = current_call()
        for req in requests:
            if call.stopped:  # past the deadline or cancelled: what is scored stays, the rest fails
                rewards.append(failed(req, self.name, self.version, call.reason))
                continue
            kind = self._kind(req.data_source)
            if kind == "none":  # no rule checks this data source (e.g. open-ended chat): a judge should
                rewards.append(not_applicable(req, self.name, self.version, f"no verifier for {req.data_source!r}"))
                continue
            if not has_ground_truth(req.ground_truth) and kind != "format":
                rewards.append(not_applicable(req, self.name, self.version, "no ground truth to verify against"))
                continue
            truth = episode_truth(req.ground_truth, req.prompt_id, req.sample_idx)
            try:
                check = verify(kind, req.response_text, truth, style, limits, e.math_timeout_s)
                rewards.append(Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=check.score,
                                      correct=check.correct, source=self.name, source_version=self.version,
                                      details={"verifier": kind, **check.details},
                                      suspicious=list(check.suspicious)))
            except Exception as exc:  # a verifier bug or bad ground truth must not lose the sample
                self.failed += 1
                rewards.append(failed(req, self.name, self.version, exc))
            self.scored += 1
        return rewards

    def compare(self, pairs: list[PairRequest]) -> list[dict]:
        """Verdicts of pairs, in the generative judge's shape (`asyncrl.rewards.judge.GenerativeJudge.compare`):
        each response checked against `truth` as `score` checks a sample (the data source's verifier,
        the style, the sandbox limits, the call's deadline); `p_first` 1 when the first scores higher,
        0 when lower, 0.5 when equal; `consistent` always (a rule does not read the order). With
        `second_is_reference` the second is the ground truth itself: a correct check's score. A pair
        either of whose checks could not be made is `failed`, the reason in `error`. A response is
        checked once per call however many pairs it is in (a group's G responses make G(G−1)/2 pairs)."""
        limits, style, call = self._limits(), self.endpoint.style or self.default_style, current_call()
        checks: dict[tuple[str, str, str], Check | Exception] = {}

        def check(pair: PairRequest, response: str) -> Check:
            key = (pair.data_source, ground_truth_text(pair.truth), response)
            if key not in checks:
                try:
                    checks[key] = self._check_pair_side(pair, response, style, limits)
                except CallStopped:  # not the response's doing: never kept
                    raise
                except Exception as exc:  # the same response fails the same way in its other pairs
                    checks[key] = exc
            if isinstance(checks[key], Exception):
                raise checks[key]
            return checks[key]

        out = []
        for pair in pairs:
            try:
                call.check()  # past the deadline or cancelled: the pairs judged stay, the rest fail
                first = check(pair, pair.first)
                second = (Check(score_from_correct(True, style), True, {}) if pair.second_is_reference
                          else check(pair, pair.second))
            except Exception as exc:  # no verdict: Pairwise PPO drops the group, never trains a made-up tie
                out.append({"p_first": 0.5, "consistent": True, "failed": True, "error": failure_reason(exc)})
                self.failed_pairs += 1
                continue
            p_first = 1.0 if first.score > second.score else 0.0 if first.score < second.score else 0.5
            out.append({"p_first": p_first, "consistent": True, "failed": False, "score_first": first.score,
                        "score_second": second.score})
        self.pairs += len(pairs)
        return out

    def _check_pair_side(self, pair: PairRequest, response: str, style: str, limits: SandboxLimits) -> Check:
        """One response of a pair checked against its ground truth; raises where no check can be made."""
        kind = self._kind(pair.data_source)
        if kind == "none":
            raise ValueError(f"no verifier for {pair.data_source!r}")
        if not has_ground_truth(pair.truth) and kind != "format":
            raise ValueError("no ground truth to verify against")
        if isinstance(pair.truth, str) and pair.truth == EPISODE_TRUTH:
            raise ValueError("each episode has its own answer (tiny_tool): a pair of them has no common truth")
        return verify(kind, response, pair.truth, style, limits, self.endpoint.math_timeout_s)

    def stats(self) -> dict:
        return {"scored": self.scored, "failed": self.failed, "pairs": self.pairs, "failed_pairs": self.failed_pairs,
                "version": self.version}
