"""The run's status as every view shows it (`/train/status`, the status page, Prometheus, the
driver's summary): one summary of the roles' own stats, typed (`RunStatus`), built in one place
(`system_status`) and turned into JSON in one (`RunStatus.json_dict`)."""

from __future__ import annotations

import msgspec
import numpy as np

from asyncrl.messages.mailbox import MailboxStats
from asyncrl.messages.ray_mailbox import ShardedMailbox


def answered(calls: dict, timeout_s: float) -> list[dict]:
    """The generators' stats that came back within `timeout_s`; one that did not is listed as
    unresponsive (a hung or cut-off generator must not hang the status of the whole run)."""
    import ray

    ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout_s)
    out = []
    for gid, ref in calls.items():
        try:
            out.append(ray.get(ref) if ref in ready else {"generator_id": gid, "unresponsive": True})
        except ray.exceptions.RayError:  # it died: the pool heals it
            out.append({"generator_id": gid, "unresponsive": True})
    return out


def mailbox_actors(box) -> list:
    """The actors behind a mailbox client (one, or one per shard)."""
    return box.actors if isinstance(box, ShardedMailbox) else [box.actor]


def reward_endpoint_table(reward, seen: dict[str, dict], own: dict[str, dict]) -> dict[str, dict]:
    """One row per configured reward endpoint: its kind, where it runs, and, as the run's reward
    router saw them, the version it last answered with, its rewards (by version) and failures. The
    same under Serve (where the endpoints are applications, not actors of the run) as with actors,
    whose own counters (e.g. a judge's pairs) come first."""
    table = {}
    for name, endpoint in reward.endpoints.items():
        mine = own.get(name, {})
        table[name] = {**mine, "kind": endpoint.kind,
                       "where": f"serve app reward-{name}" if reward.use_serve else "actor",
                       "version": str(mine.get("version", "")), "rewards": 0, "failed": 0, "versions": {},
                       "last_error": "", "last_answer_at": 0.0, **seen.get(name, {})}
    return table


class MailboxDepth(msgspec.Struct, kw_only=True):
    """A mailbox's depth as the status shows it (its shards summed)."""

    queued: int
    leased: int
    capacity: int
    bytes: int  # of the messages held, encoded
    bytes_peak: int


class PoolStatus(msgspec.Struct, kw_only=True):
    """The generator pool (`asyncrl.run.pool`): the size it is held to and who is in it."""

    target: int
    generators: list[str]  # ids, oldest first
    weight_paths: dict[str, str]  # generator id -> its weight path (`asyncrl.weights.transport`)
    failed_deliveries: dict[str, str]  # generator id -> why the learner's delivery to it failed


class RunStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The run's status, built once per read (`system_status`); `json_dict` is the one conversion
    to the JSON every view shows (`/train/status`, the status page, Prometheus, `summary.json`'s
    `final_status`). The roles' own stats (`assembler`, `prompt_source`, each generator's, ...) are
    their dicts, as each role reports them."""

    step: int  # the policy learner's
    weight_version: int
    delivered_version: int  # the newest version every generator holds
    samples_generated: int  # finished by the generators that answered
    tool_calls: int  # episodes' calls answered
    tool_errors: int
    samples_trained: int
    stale_tokens_masked: int
    steps_skipped: int
    samples_dropped: int
    dropped_by_reason: dict[str, int]
    reward_mean: float  # of every scored sample
    generator_busy_fraction: float  # the mean over the generators that answered
    generator_paused_for_weights_fraction: float
    learner_busy_fraction: float
    learner_wait_batch_s: float  # the learner's wait for batches, in all
    learner_node: str
    last_broadcast: dict
    last_checkpoint: dict
    queue_depths: dict[str, MailboxDepth]
    generators: list[dict]  # each generator's stats, or {generator_id, unresponsive: true}
    assembler: dict
    wall_time_s: float  # since this incarnation started
    value_learner: dict | None = None  # a value-based algorithm's critic
    environment: dict | None = None  # a task's environment endpoint
    reward_endpoints: dict[str, dict]  # `reward_endpoint_table`
    prompt_source: dict
    ledger: dict  # the ledger's counts and its problems
    resumed: dict  # where this incarnation resumed from (empty: a fresh run)
    pre_ppo: dict  # Pre-PPO's selection
    pool: PoolStatus

    def json_dict(self) -> dict:
        """The status as JSON builtins, the shape every view reads."""
        return msgspec.to_builtins(self, enc_hook=_plain)


def _plain(value):
    """A value a role reported that JSON has no form for: numpy's numbers as Python's, the rest as `str`."""
    return value.item() if isinstance(value, np.generic) else str(value)


def run_figures(learner: dict, all_generators: list[dict], assembler: dict, mailboxes: dict[str, MailboxStats]) -> dict:
    """The run's figures from the learner's, the generators' and the assembler's stats (the fields
    of `RunStatus` up to `assembler`)."""
    generators = [g for g in all_generators if not g.get("unresponsive")]
    return {
        "step": learner["step"],
        "weight_version": learner["weight_version"],
        "delivered_version": learner.get("delivered_version", 0),
        "samples_generated": sum(g["samples_finished"] for g in generators),
        "tool_calls": sum(g.get("tool_calls", 0) for g in generators),
        "tool_errors": sum(g.get("tool_errors", 0) for g in generators),
        "samples_trained": learner["samples_trained"],
        "stale_tokens_masked": learner.get("stale_tokens_masked", 0),
        "steps_skipped": learner.get("steps_skipped", 0),
        "samples_dropped": assembler.get("samples_dropped", 0),
        "dropped_by_reason": {k.removeprefix("dropped_").removesuffix("_samples"): v for k, v in assembler.items()
                              if k.startswith("dropped_") and k.endswith("_samples")},
        "reward_mean": assembler.get("reward_mean_all", 0.0),
        "generator_busy_fraction": sum(g["busy_fraction"] for g in generators) / max(len(generators), 1),
        "generator_paused_for_weights_fraction": sum(g["paused_for_weights_fraction"] for g in generators) / max(len(generators), 1),
        "learner_busy_fraction": learner["busy_fraction"],
        "learner_wait_batch_s": learner.get("wait_batch_s", 0.0),
        "learner_node": learner.get("node_ip", ""),
        "last_broadcast": learner["last_broadcast"],
        "last_checkpoint": learner.get("last_checkpoint", {}),
        "queue_depths": {name: MailboxDepth(queued=s.queued, leased=s.leased, capacity=s.capacity, bytes=s.bytes,
                                            bytes_peak=s.bytes_peak) for name, s in mailboxes.items()},
        "generators": all_generators,
        "assembler": assembler,
    }


def reward_failure_lines(health: dict, announced: set[str], fail_fast_samples: int) -> tuple[list[str], str]:
    """What a run says of failing rewards (`health`: `System.reward_health`): each endpoint's first
    failure once (`announced` holds the endpoints already said), with the exception and the sample;
    and when every reward of at least `fail_fast_samples` scored samples failed (0: never), the one
    line the run stops on ("" otherwise)."""
    notices, first = [], ""
    for name, seen in sorted(health["endpoints"].items()):
        failure = seen["first_failure"]
        if not failure:
            continue
        said = (f"reward endpoint {name!r} failed: {failure['error']} "
                f"(prompt {failure['prompt_id']}, sample {failure['sample_idx']})")
        first = first or said
        if name not in announced:
            announced.add(name)
            notices.append(f"{said}; failed rewards are counted in each step's reward_failed")
    scored, failed = health["samples_scored"], health["reward_failures"]
    if fail_fast_samples and scored >= fail_fast_samples and failed == scored:
        return notices, (f"every reward of the first {scored} samples failed, so nothing can be learned: {first}. "
                         f"Fix the reward and start again (reward.fail_fast_samples=0 trains on regardless)")
    return notices, ""


def system_status(system) -> RunStatus:
    """The status of one incarnation (`asyncrl.run.wiring.System`): every role's stats, each call
    bounded (a role past its deadline is `RoleHung`; a generator that does not answer is listed as
    unresponsive), summarised, with the ledger, the reward endpoints, the pool and the resume."""
    import time

    from asyncrl.run.deadlines import answer

    def stats(name: str) -> dict:
        return answer(system.actors[name].stats.remote(), name, "stats")

    learner = stats("learner")
    generators = answered({gid: g.stats.remote() for gid, g in system.generators.items()}, timeout_s=5.0)
    assembler = stats("assembler")
    mailboxes = {name: system.mailbox_stats(name) for name in system.mailboxes}
    figures = run_figures(learner, generators, assembler, mailboxes)
    roles = {role: stats(role) for role in ("value_learner", "environment") if role in system.actors}
    endpoints = reward_endpoint_table(
        system.config.reward, assembler.get("reward_router", {}).get("endpoints", {}),
        {name.removeprefix("reward-"): stats(name) for name in system.actors if name.startswith("reward-")})
    prompt_source = stats("prompt_source")
    ledger = {**prompt_source.pop("ledger"), "problems": prompt_source.pop("ledger_problems")}
    pool = PoolStatus(target=system.pool.target, generators=list(system.generators),
                      weight_paths=dict(system.pool.weight_paths), failed_deliveries=learner.get("failed_generators", {}))
    return RunStatus(**figures, wall_time_s=time.time() - system.started_at, **roles, reward_endpoints=endpoints,
                     prompt_source=prompt_source, ledger=ledger, resumed=system.resumed, pre_ppo=system.pre_ppo, pool=pool)
