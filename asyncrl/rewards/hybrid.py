"""Hybrid reward: route each request to the endpoints its data source names, call them within a
deadline, and combine their rewards (pure `combine_rewards`).

Every combined `Reward` records which endpoints produced it and their versions; a timeout, an
exception or a malformed answer becomes a failed reward with the reason, never a lost sample.

One deadline (`reward.timeout_s`) bounds an endpoint's answer to a call, retries included: an
error is retried while time is left; a call still running at the deadline is cancelled at the
endpoint and not retried. A slow endpoint then gets no more work than it was given, where a
timeout per attempt left each timed-out call running while its retry added another. A pairwise
judgement has the same deadline. The endpoint is told the deadline less the time to answer
(`endpoint_budget`): it stops there and answers with the rewards it scored, so a call with one
slow sample keeps the others'. Every failure text is recorded masked (`asyncrl.redaction`).
"""

from __future__ import annotations

import asyncio
import fnmatch
import time
from typing import Any, Awaitable, Callable

import msgspec
import numpy as np

from asyncrl.config import (GenerativeJudgeEndpoint, OpenAIJudgeEndpoint, RewardConfig, RouteConfig,
                            VerifierEndpoint)
from asyncrl.messages.structs import PairRequest, Reward, RewardRequest
from asyncrl.redaction import masked, register_secret_env

# (endpoint name, requests, budget_s: how long the endpoint may work before it answers with what it has)
CallFn = Callable[[str, list[RewardRequest], float], Awaitable[list[Reward]]]
CompareFn = Callable[[str, list[PairRequest], float], Awaitable[list[dict]]]
# What an endpoint keeps of the time left to answer with the rewards it scored, before the router's
# deadline cancels the call: the answer crosses Ray or Serve, and a thread must notice the stop.
ANSWER_MARGIN_SHARE = 0.2
ANSWER_MARGIN_MAX_S = 5.0


def endpoint_budget(remaining_s: float) -> float:
    """The time an endpoint may score for, of the `remaining_s` before the router's deadline."""
    return max(0.0, remaining_s - min(ANSWER_MARGIN_MAX_S, ANSWER_MARGIN_SHARE * remaining_s))


def with_masked_error(reward: Reward) -> Reward:
    """The reward with its failure text masked (an endpoint in another process may not know the key)."""
    if "error" not in reward.details:
        return reward
    return msgspec.structs.replace(reward, details={**reward.details, "error": masked(reward.details["error"])})


def route_for(data_source: str, routes: list[RouteConfig]) -> RouteConfig:
    for route in routes:
        if fnmatch.fnmatchcase(data_source, route.match):
            return route
    raise ValueError(f"no reward route matches data source {data_source!r}")


def needs_ground_truth(data_source: str, reward: RewardConfig) -> bool:
    """No endpoint of the data source's route can score a response without a ground truth: every
    one is a verifier that checks against one, or a pointwise judge (which grades against the
    reference). A reward function of the user's, a reward model or a format check may need none."""
    from asyncrl.rewards.verifiers import kind_for

    def needs(endpoint) -> bool:
        if isinstance(endpoint, VerifierEndpoint):
            return (endpoint.verifier_kinds.get(data_source) or kind_for(data_source)) not in ("format", "none")
        return isinstance(endpoint, (GenerativeJudgeEndpoint, OpenAIJudgeEndpoint)) and endpoint.judge_mode == "pointwise"

    route = route_for(data_source, reward.routes)
    return all(needs(reward.endpoints[name]) for name in route.endpoints)


def _applies(reward: Reward) -> bool:
    return not reward.failed


def combine_rewards(request: RewardRequest, route: RouteConfig, by_endpoint: dict[str, Reward]) -> Reward:
    """The reward of one request from the rewards of the route's endpoints (all already called)."""
    primary = [by_endpoint[name] for name in route.endpoints if name in by_endpoint]
    if route.combine == "first":
        chosen = next((r for r in primary if _applies(r)), None)
        if chosen is None:  # nothing applied: keep the first failure's reason
            chosen = primary[0] if primary else Reward(prompt_id=request.prompt_id, sample_idx=request.sample_idx,
                                                       score=0.0, source="none", failed=True,
                                                       details={"error": "no endpoint answered"})
        score, correct, failed = chosen.score, chosen.correct, chosen.failed
        source, versions = chosen.source, [chosen.source_version]
        details = {"route": route.match, "chosen": chosen.source, **{f"{chosen.source}.{k}": v for k, v in chosen.details.items()}}
        if chosen.details.get("extra"):  # a user function's other numbers, averaged into the step records
            details["extra"] = chosen.details["extra"]
        if failed:
            details["error"] = str(chosen.details.get("error", "failed"))
    else:  # mix
        weighted = [(w, by_endpoint[name]) for name, w in zip(route.endpoints, route.weights)
                    if name in by_endpoint and _applies(by_endpoint[name])]
        total = sum(w for w, _ in weighted)
        failed = total <= 0
        score = sum(w * r.score for w, r in weighted) / total if total > 0 else 0.0
        verifiers = [r for _, r in weighted if r.correct is not None]
        correct = verifiers[0].correct if verifiers else (score > 0.5 if not failed else False)
        source = "mix(" + ",".join(f"{r.source}:{w:g}" for w, r in weighted) + ")"
        versions = [r.source_version for _, r in weighted]
        details = {"route": route.match, **{f"{r.source}.score": r.score for _, r in weighted}}
        extra = {f"{r.source}.{k}": v for _, r in weighted for k, v in (r.details.get("extra") or {}).items()}
        if extra:
            details["extra"] = extra
        if failed:
            details["error"] = "; ".join(str(r.details.get("error", "")) for r in primary)[:500]
    token_rewards = None
    for name in route.dense:
        dense = by_endpoint.get(name)
        if dense is None or dense.failed or dense.token_rewards is None:
            continue
        lam = route.dense_lambda_pass if correct else route.dense_lambda_fail
        part = lam * dense.token_rewards.astype(np.float32)
        token_rewards = part if token_rewards is None else _add_aligned(token_rewards, part)
        versions.append(dense.source_version)
        details[f"{name}.lambda"] = lam
    # Hacking seen by any endpoint consulted counts, whichever one's score was used.
    suspicious = sorted({s for r in by_endpoint.values() for s in r.suspicious})
    return Reward(prompt_id=request.prompt_id, sample_idx=request.sample_idx, score=float(score), correct=correct,
                  source=source, source_version="+".join(v for v in versions if v), token_rewards=token_rewards,
                  failed=failed, details=details, suspicious=suspicious)


def _add_aligned(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros(max(len(a), len(b)), dtype=np.float32)
    out[: len(a)] += a
    out[: len(b)] += b
    return out


class ServeRewardEndpoints:
    """Calls reward endpoints deployed as Serve applications (`reward-<name>`).

    Handles are kept, not looked up per call: while a redeploy with new args rebuilds the
    application, a lookup fails ("does not exist") for seconds, but a handle held keeps routing to
    the replicas that serve until the rolling update replaces them. A handle is dropped after a
    failed call, so an application deleted and deployed again is found on the retry.
    """

    def __init__(self) -> None:
        self.handles: dict[str, Any] = {}

    def _handle(self, name: str):
        if name not in self.handles:
            from ray import serve

            self.handles[name] = serve.get_app_handle(f"reward-{name}")
        return self.handles[name]

    async def _call(self, name: str, method: str, payload: list, budget_s: float | None):
        try:
            response = getattr(self._handle(name), method).remote(payload, budget_s)
        except Exception:
            self.handles.pop(name, None)
            raise
        try:
            return await response
        except asyncio.CancelledError:  # the caller's deadline: the replica stops this request
            response.cancel()
            raise
        except Exception:
            self.handles.pop(name, None)
            raise

    async def score(self, name: str, requests: list[RewardRequest], budget_s: float | None = None) -> list[Reward]:
        return await self._call(name, "score", requests, budget_s)

    async def compare(self, name: str, pairs: list, budget_s: float | None = None) -> list[dict]:
        return await self._call(name, "compare", pairs, budget_s)


async def cancelling(ref):
    """Await an actor call; if the awaiting task is cancelled (a deadline), cancel the call too."""
    import ray

    try:
        return await ref
    except asyncio.CancelledError:
        ray.cancel(ref)
        raise


class RewardRouter:
    """Holds the routes (changeable at run time: the admin route) and the endpoint callers. Every
    reward a run asks for goes through one: the assembler's scores, Pairwise PPO's judged pairs
    (`compare`) and Pre-PPO's candidate scores."""

    def __init__(self, routes: list[RouteConfig], call: CallFn, timeout_s: float = 120.0, retries: int = 2,
                 compare: CompareFn | None = None):
        self.routes = routes
        self.call = call
        self._compare = compare
        self.timeout_s = timeout_s
        self.retries = retries
        self.counters: dict[str, int] = {"calls": 0, "retries": 0, "timeouts": 0, "errors": 0}
        self.latencies: list[float] = []
        # Per endpoint, as the caller sees it (the same whether it is an actor or a Serve app): what
        # it answered, under which version, and what failed. The status page's endpoint table.
        self.endpoints: dict[str, dict[str, Any]] = {}

    def set_routes(self, routes: list[RouteConfig]) -> None:
        self.routes = routes

    async def _call_endpoint(self, name: str, requests: list[RewardRequest]) -> list[Reward]:
        deadline = time.monotonic() + self.timeout_s
        last_error = ""
        for attempt in range(self.retries + 1):
            start = time.perf_counter()
            try:
                self.counters["calls"] += 1
                remaining = deadline - time.monotonic()
                rewards = await asyncio.wait_for(self.call(name, requests, endpoint_budget(remaining)), timeout=remaining)
                if len(rewards) != len(requests):
                    raise ValueError(f"endpoint {name} answered {len(rewards)} rewards for {len(requests)} requests")
                self.latencies = (self.latencies + [time.perf_counter() - start])[-1000:]
                rewards = [with_masked_error(r) for r in rewards]
                self._count(name, rewards)
                return rewards
            except asyncio.TimeoutError:  # the deadline is spent: the call was cancelled, no retry
                self.counters["timeouts"] += 1
                last_error = f"endpoint {name} did not answer within the {self.timeout_s:g}s deadline"
                break
            except Exception as exc:  # a dead replica, a swap in progress, a bad answer: retry
                self.counters["errors"] += 1
                last_error = masked(f"endpoint {name}: {type(exc).__name__}: {exc}")[:500]
            backoff = min(0.5 * 2**attempt, 5.0)
            if attempt == self.retries or time.monotonic() + backoff >= deadline:
                break
            self.counters["retries"] += 1
            await asyncio.sleep(backoff)
        failed = [Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=0.0, correct=False, source=name,
                         failed=True, details={"error": last_error}) for r in requests]
        self._count(name, failed, last_error)
        return failed

    def _count(self, name: str, rewards: list[Reward], error: str = "") -> None:
        seen = self.endpoints.setdefault(name, {"version": "", "rewards": 0, "failed": 0, "versions": {},
                                                "last_error": "", "last_answer_at": 0.0, "first_failure": {}})
        for reward in rewards:
            seen["rewards"] += 1
            seen["failed"] += int(reward.failed)
            if reward.failed and not seen["first_failure"]:  # what the console says once, at once
                seen["first_failure"] = {"error": masked(reward.details.get("error", error or "failed"))[:500],
                                         "prompt_id": reward.prompt_id, "sample_idx": reward.sample_idx}
            if not reward.failed:
                seen["version"] = reward.source_version
                seen["versions"][reward.source_version] = seen["versions"].get(reward.source_version, 0) + 1
        if error:
            seen["last_error"] = masked(error)
        else:
            seen["last_answer_at"] = time.time()

    async def score(self, requests: list[RewardRequest]) -> list[Reward]:
        routes = [route_for(r.data_source, self.routes) for r in requests]
        wanted: dict[str, list[int]] = {}
        for i, route in enumerate(routes):
            names = list(route.endpoints) + list(route.dense)
            if route.combine == "first":
                # Call the first endpoint; the rest only for requests it does not apply to.
                names = names[:1] + list(route.dense)
            for name in names:
                wanted.setdefault(name, []).append(i)
        answers: dict[int, dict[str, Reward]] = {i: {} for i in range(len(requests))}

        async def run(name: str, indices: list[int]) -> None:
            rewards = await self._call_endpoint(name, [requests[i] for i in indices])
            for i, reward in zip(indices, rewards):
                answers[i][name] = reward

        await asyncio.gather(*(run(n, idx) for n, idx in wanted.items()))
        # Fall through for "first" routes whose earlier endpoints did not apply.
        for depth in range(1, max((len(r.endpoints) for r in routes), default=1)):
            pending: dict[str, list[int]] = {}
            for i, route in enumerate(routes):
                if route.combine != "first" or depth >= len(route.endpoints):
                    continue
                tried = route.endpoints[:depth]
                if all(name in answers[i] and not _applies(answers[i][name]) for name in tried):
                    pending.setdefault(route.endpoints[depth], []).append(i)
            if not pending:
                break
            await asyncio.gather(*(run(n, idx) for n, idx in pending.items()))
        return [combine_rewards(req, route, answers[i]) for i, (req, route) in enumerate(zip(requests, routes))]

    async def compare(self, name: str, pairs: list[PairRequest]) -> list[dict]:
        """Pairs judged by the endpoint `name` (a pairwise generative judge, or the verifier)."""
        if self._compare is None:
            raise ValueError("this reward router has no pairwise judge")
        try:
            out = await asyncio.wait_for(self._compare(name, pairs, endpoint_budget(self.timeout_s)),
                                         timeout=self.timeout_s)
        except asyncio.TimeoutError:  # no verdict: the group is dropped as reward_failed, not trained on a tie
            self.counters["timeouts"] += 1
            error = f"judge {name} did not answer within the {self.timeout_s:g}s deadline"
            self._count(name, [], error)
            return [{"p_first": 0.5, "consistent": True, "failed": True, "error": error} for _ in pairs]
        return [{**o, "error": masked(o["error"])} if "error" in o else o for o in out]

    def failures(self) -> dict[str, dict]:
        """Each endpoint's rewards, failures and first failure: what a run reads at every poll."""
        return {name: {"rewards": seen["rewards"], "failed": seen["failed"], "first_failure": dict(seen["first_failure"])}
                for name, seen in self.endpoints.items()}

    def stats(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0)
        return {**self.counters, "latency_p50_s": pct(0.5), "latency_p99_s": pct(0.99),
                "endpoints": {name: {**seen, "versions": dict(seen["versions"]), "first_failure": dict(seen["first_failure"])}
                              for name, seen in self.endpoints.items()}}


def build_reward_router(reward, endpoints: dict[str, Any], routes: list[RouteConfig] | None = None) -> RewardRouter:
    """A router over the run's reward endpoints (`reward`: the RewardConfig section): the actors of
    `endpoints`, or the Serve applications `reward-<name>` when `reward.use_serve`. `routes`
    default to the config's."""
    for endpoint in reward.endpoints.values():  # this process records failure texts: it masks the keys
        register_secret_env(getattr(endpoint, "api_key_env", ""))
    if reward.use_serve:
        serve_endpoints = ServeRewardEndpoints()
        call, compare = serve_endpoints.score, serve_endpoints.compare
    else:
        async def call(name, requests, budget_s):
            return await cancelling(endpoints[name].score.remote(requests, budget_s))

        async def compare(name, pairs, budget_s):
            return await cancelling(endpoints[name].compare.remote(pairs, budget_s))

    return RewardRouter(list(routes if routes is not None else reward.routes), call, reward.timeout_s,
                        reward.retries, compare=compare)
