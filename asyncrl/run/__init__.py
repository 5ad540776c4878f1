"""A training run as the CLI (`asyncrl train`) and Serve (`train` app) both use it: `Run`.

    run = Run(config, run_dir, max_steps=...).start()   # the roles up (`asyncrl.run.wiring`)
    polled = run.poll()       # health (a restart from the checkpoint when a role died), new steps
    run.weights(); run.checkpoint(); run.status()
    run.stop()

`Run` is the one door to a run: the incarnation it keeps (`asyncrl.run.wiring.System`) is private
to this package. Offline generation, the tests and the load tests drive a run through the same
methods, named after what they do: `check_alive` and `pop_metrics` (a caller that keeps the run
itself), `ledger`, `role_stats`, `mailbox_stats`, `pid`, `kill` (a fault, as a load test injects
it), `inject_generator_fault`, `reconfigure_reward`.

Keeping a run alive. The generators are an elastic pool (`asyncrl.run.pool`): one that dies or
hangs is healed in place, its work re-issued through the ledger, while the learner keeps training
on what the others produce; the pool grows and shrinks by hand (`scale`) or by policy
(`cluster.autoscale`). Any other role holds state no other process has (the learner's weights and
optimizer, the prompt source's cursor and ledger, the assembler's open groups, the value learner,
a mailbox's queue): its death brings the whole system back from the newest valid checkpoint, the
one recovery that is exact for them (docs/architecture.md, checkpoints and resume). The cost is
the steps since that checkpoint.

Every error of a poll takes that path, not only a death `check_alive` sees: an error healing the
pool, reading the metrics or the status is a part of the run that failed, and a run of days must
not end on one. Restarts are budgeted per window (`asyncrl.run.restarts`: `trainer.max_restarts`
within any `trainer.restart_window_s`, an hour by default), counted from `restarts.jsonl`, so a run that
restarted three times in a week is not one restart from its end, and a controller that replaces
another (Serve) counts the restarts before it. A spent budget raises `RestartBudgetSpent`, which
says when the next restart is allowed (Serve waits for it); a run that cannot restart at all (no
checkpoint, a start that failed) raises `RunFailed`.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import ray
from ray.exceptions import RayError, RayTaskError

from asyncrl.config import Config
from asyncrl.messages.mailbox import MailboxStats
from asyncrl.run.pool import autoscale_step
from asyncrl.run.records import RunRecords
from asyncrl.run.restarts import RestartBudgetSpent, RunFailed, earlier_restarts, restart_allowed_at
from asyncrl.run.status import RunStatus, reward_failure_lines
from asyncrl.run.wiring import System
from asyncrl.storage import checkpoint

__all__ = ["InjectedFault", "Poll", "RestartBudgetSpent", "Run", "RunFailed", "StallError", "restart_allowed_at"]

RESTART_ATTEMPTS = 4
RESTART_WAIT_S = 10.0
EXHAUSTION_CHECK_S = 5.0  # how often a quiet run asks whether every prompt is retired


class StallError(RuntimeError):
    """No learner step for `trainer.stall_timeout_s`."""


class InjectedFault(RuntimeError):
    """An error a load test injected into the poll (`Run.inject_poll_errors`)."""


@dataclass
class Poll:
    records: list[dict] = field(default_factory=list)  # new step records, as written
    restart: dict | None = None  # set when the system was restarted from a checkpoint
    retirements: list[dict] = field(default_factory=list)  # prompts retired (or back) since the last poll
    reward_notices: list[str] = field(default_factory=list)  # an endpoint's first failed reward, said once
    rewards_failing: str = ""  # every reward of the first samples failed: why (`reward.fail_fast_samples`)


class Run:
    def __init__(self, config: Config, run_dir: str, max_steps: int = 0, stall_timeout_s: float | None = None,
                 annotate: Callable[[dict], None] | None = None, loggers: Any = None, history_limit: int = 0,
                 name_learner: bool = True):
        """`name_learner`: the policy learner is registered by name, where the Serve policy app finds
        it; False for a run beside another in one Ray session (tests) or one that serves no policy."""
        self.config = config
        self.run_dir = run_dir
        self.max_steps = max_steps  # the learner stops there (0: trains until stopped, as under Serve)
        self.stall_timeout_s = config.trainer.stall_timeout_s if stall_timeout_s is None else stall_timeout_s
        self.log = RunRecords(run_dir, annotate, loggers, history_limit, config.trainer.log_file_mb << 20,
                              config.trainer.log_files_kept)
        self.restarts: list[dict[str, Any]] = []  # this process's restarts
        # When restarts were tried (this process's and, from restarts.jsonl, earlier ones): the budget.
        self.restart_times: list[float] = earlier_restarts(run_dir, config.trainer.restart_window_s)
        self.inject_poll_errors = 0  # load tests: the next N polls raise `InjectedFault`
        self.name_learner = name_learner
        self._system: System | None = None  # the running incarnation
        self.last_status: RunStatus | None = None  # the status read at the last poll with new steps
        self.last_step_at = time.time()
        self._exhaustion_checked_at = 0.0
        self._autoscale = {"at": time.monotonic(), "wait_batch_s": 0.0, "polls": 0, "batches_full": 0}
        self._rewards_announced: set[str] = set()  # endpoints whose first failure was said
        self.rewards_failing = ""  # the status says it under Serve, where the run goes on

    def start(self) -> "Run":
        self._system = System(self.config, self.run_dir, self.max_steps, self.name_learner,
                              on_pool_event=self.log.pool_event).start()
        self.log.started = self.last_step_at = time.time()
        return self

    @property
    def records(self) -> list[dict]:
        return self.log.records

    @property
    def resumed(self) -> dict:
        return self._system.resumed

    @property
    def step(self) -> int:
        return self.records[-1]["step"] if self.records else self._system.resumed.get("step", 0)

    def check(self) -> dict | None:
        """None while every role's loop runs (generators that died or hung are healed in place);
        after any other failure, the run restarted from the newest checkpoint (the event, also in
        `restarts.jsonl`), or raise when it cannot recover (`RunFailed`)."""
        try:
            dead = self._system.check_alive()
            self._system.pool.check(dead)  # generators: healed in place, replaced while there is room
        except Exception as exc:  # a role's loop ended (its error, ActorDiedError), or the healing failed
            return self.restart_after(exc)
        return None

    def poll(self, check_health: bool = True) -> Poll:
        """One look at the run; raises when it cannot recover (`RunFailed`), or `StallError` when it
        stalled. Any other error restarts the run. `check_health=False`: only record the steps done
        (after the learner was stopped on purpose); errors then propagate."""
        if check_health:
            restart = self.check()
            if restart is not None:
                return Poll(restart=restart)
        try:
            return self._observe()
        except StallError:
            raise
        except Exception as exc:
            if not check_health:
                raise
            return Poll(restart=self.restart_after(exc))

    def _observe(self) -> Poll:
        """The new step records, stamped with the status; the prompts' state when the run is quiet."""
        if self.inject_poll_errors > 0:
            self.inject_poll_errors -= 1
            raise InjectedFault("an error injected into the run's poll (load test)")
        notices, self.rewards_failing = reward_failure_lines(
            self._system.reward_health(), self._rewards_announced, self.config.reward.fail_fast_samples)
        new = self._system.pop_metrics()
        if not new:
            quiet_s = time.time() - self.last_step_at
            if quiet_s > EXHAUSTION_CHECK_S and time.time() - self._exhaustion_checked_at > EXHAUSTION_CHECK_S:
                # With every prompt retired no step comes: that is the run's end, not a stall.
                self._exhaustion_checked_at = time.time()
                self.log.note_prompts(self._system.status().json_dict())
            if quiet_s > self.stall_timeout_s and not self.log.prompts_exhausted:
                status = self._system.status()
                raise StallError(
                    f"no learner step for {self.stall_timeout_s:.0f}s at step {status.step}; "
                    f"samples dropped by reason: {status.dropped_by_reason}, "
                    f"queues: {msgspec.to_builtins(status.queue_depths)}, prompts: {_prompt_state(status.prompt_source)}"
                    + (f"; the last reward failure: {failure}" if (failure := status.assembler.get(
                        "last_reward_failure")) else ""))
            return Poll(reward_notices=notices, rewards_failing=self.rewards_failing)
        self.last_step_at = time.time()
        self.last_status = self._system.status()
        retirements = self.log.add(new, self.last_status.json_dict(), bool(self._system.resumed))
        if self.config.cluster.autoscale:
            self._autoscale_step(self.last_status)
        return Poll(records=new, retirements=retirements, reward_notices=notices, rewards_failing=self.rewards_failing)

    def restart_after(self, exc: BaseException, reason: str = "") -> dict:
        """`exc` ended this incarnation: restart from the checkpoint, record it (`restarts.jsonl`);
        raise `RunFailed` if it cannot. `reason`: the restart's (default: `exc` in one line)."""
        refused = exc if isinstance(exc, checkpoint.DiskRefused) else exc.__cause__
        if isinstance(refused, checkpoint.DiskRefused):
            # The disk would refuse the restarted run too (its checkpoints, its store): one error, no restarts.
            raise checkpoint.DiskRefused(_cause_message(refused)) from exc
        reason = reason or f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        try:
            restart = self.restart(reason, exc)
        except RunFailed as failed:
            # A refused restart (no checkpoint, the budget spent) spends no budget; a failed start does.
            self._write_restart({"reason": reason, "at": time.time(), "failed": str(failed)[:500],
                                 "attempted": failed.attempted})
            raise
        self.log.after_restart(restart["step"])
        self._write_restart(restart)
        self.last_step_at = time.time()
        return restart

    def _write_restart(self, event: dict) -> None:
        if self.run_dir:
            self.log.append("restarts.jsonl", [event])  # rolled past trainer.log_file_mb, as every log

    def scale(self, count: int, reason: str = "admin") -> list[dict]:
        """Grow or shrink the generator pool to `count` (within `cluster.max_generators`)."""
        limit = self.config.cluster.max_generators
        if not 1 <= count <= limit:
            raise ValueError(f"the pool's size must be between 1 and cluster.max_generators={limit}, got {count}")
        return self._system.pool.scale(count, reason)

    def _autoscale_step(self, status: RunStatus) -> None:
        """Every `cluster.autoscale_every_s`: one generator more when the learner waited for batches,
        one fewer when batches waited for the learner (`autoscale_step`)."""
        window = self._autoscale
        window["polls"] += 1
        batches = status.queue_depths.get("batches")
        window["batches_full"] += int(batches is not None and batches.queued >= batches.capacity)
        elapsed = time.monotonic() - window["at"]
        if elapsed < self.config.cluster.autoscale_every_s:
            return
        waited = status.learner_wait_batch_s - window["wait_batch_s"]
        cl = self.config.cluster
        target = autoscale_step(len(self._system.generators), cl.min_generators, cl.max_generators,
                                waited / elapsed, window["batches_full"] / window["polls"])
        self._autoscale = {"at": time.monotonic(), "wait_batch_s": status.learner_wait_batch_s, "polls": 0,
                           "batches_full": 0}
        if target != len(self._system.generators):
            self._system.pool.scale(target, f"autoscale: learner waited {waited / elapsed:.0%} of the last "
                                           f"{elapsed:.0f}s for batches")

    def restart(self, reason: str, cause: BaseException | None = None) -> dict:
        """Bring the system back from the newest valid checkpoint; the event. Raises
        `RestartBudgetSpent` when the window's budget is spent (retry at its `retry_at`), `RunFailed`
        when there is no checkpoint or the system could not start."""
        start = time.perf_counter()
        # Stop first: a learner still alive could otherwise commit newer checkpoints and prune the
        # one chosen below.
        self._system.stop()
        latest, _ = checkpoint.latest_valid(self.run_dir) if self.run_dir else (None, [])
        if latest is None:
            raise RunFailed(f"the run cannot recover (no checkpoint to restart from) from: {reason}") from cause
        trainer, now = self.config.trainer, time.time()
        retry_at = restart_allowed_at(self.restart_times, now, trainer.max_restarts, trainer.restart_window_s)
        if retry_at is not None:
            budget = f"trainer.max_restarts={trainer.max_restarts} within {trainer.restart_window_s:g}s used up"
            if retry_at == float("inf"):
                raise RunFailed(f"the run cannot recover ({budget}) from: {reason}") from cause
            raise RestartBudgetSpent(f"the run cannot restart before {time.strftime('%H:%M:%S', time.localtime(retry_at))} "
                                     f"({budget}) after: {reason}", retry_at, reason) from cause
        self.restart_times.append(now)  # an attempt spends the budget, whether or not it starts
        resumed = msgspec.structs.replace(self.config, resume=True)
        for attempt in range(RESTART_ATTEMPTS):
            try:
                self._system = System(resumed, self.run_dir, self.max_steps, self.name_learner,
                                      num_generators=self._system.pool.target, on_pool_event=self.log.pool_event).start()
                break
            except RayError as exc:
                # A node that is dying may still take actors until Ray has marked it dead (its
                # heartbeats time out): they die with it. Try again once that has happened.
                if attempt == RESTART_ATTEMPTS - 1:
                    raise RunFailed(f"the run could not restart after {reason}: {exc}", attempted=True) from exc
                time.sleep(RESTART_WAIT_S)
            except Exception as exc:  # a checkpoint it could not load, a bad setting: not one to retry
                raise RunFailed(f"the run could not restart after {reason}: {type(exc).__name__}: {exc}",
                                attempted=True) from exc
        event = {"reason": reason, "restart_s": time.perf_counter() - start, "at": now,  # when it was tried
                 **{k: self._system.resumed[k] for k in ("checkpoint", "step", "reissued_prompts", "saved_batches")}}
        if cause is not None:  # where it failed, for whoever reads restarts.jsonl (the reason is one line)
            event["error"] = "".join(traceback.format_exception(cause))[-4000:]
        self.restarts.append(event)
        return event

    def stop_learning(self) -> None:
        self._system.stop_learning()

    def drain(self, timeout_s: float = 120.0) -> dict:
        """Issue nothing more, let the work in flight end, and say what the ledger shows then
        (`System.drain`): a drained run has nothing in flight that no generator holds."""
        return self._system.drain(timeout_s)

    def checkpoint(self) -> str:
        try:
            return self._system.checkpoint()
        except checkpoint.CheckpointWriteError as exc:  # the learner's message, not Ray's wrapping
            raise checkpoint.CheckpointWriteError(_cause_message(exc)) from None

    def checkpoint_ref(self):
        """A checkpoint now, as an awaitable reference (the Serve app awaits it on its event loop)."""
        return self._system.actors["learner"].save_checkpoint.remote()

    def status(self) -> RunStatus:
        """Every role's status, the ledger's and the pool's, typed (`RunStatus.json_dict`: as JSON)."""
        return self._system.status()

    @property
    def generator_ids(self) -> list[str]:
        return list(self._system.generators)

    def set_reward_routes(self, routes: list[dict]):
        """New reward routes for the assembler (validated there; the next scores use them), as an
        awaitable reference."""
        return self._system.actors["assembler"].set_reward_routes.remote(routes)

    def weights(self):
        return self._system.weights()

    # --- its parts by name (a role, a generator's id, `mailbox-<name>`): offline generation, tests, load tests

    def check_alive(self) -> list[str]:
        """Raise the error of any role's loop that ended; the generators whose loops ended, not healed
        (`check` heals them, and restarts the run after any other death)."""
        return self._system.check_alive()

    def pop_metrics(self) -> list[dict]:
        """The learner's new step records, neither stamped nor written (`poll` does both)."""
        return self._system.pop_metrics()

    def ledger(self) -> dict:
        """The prompt source's ledger: its counts, its problems, the ids trained."""
        return self._system.ledger()

    def sample_states(self, sample_ids: list[str]) -> dict[str, str | None]:
        """Each sample's state in the ledger (None: never admitted)."""
        return ray.get(self._system.actors["prompt_source"].sample_states.remote(sample_ids))

    @property
    def role_names(self) -> list[str]:
        """The roles of the running incarnation (the generators are `generator_ids`)."""
        return list(self._system.actors)

    def role_stats(self, role: str, timeout_s: float | None = None) -> dict:
        """A role's or a generator's own stats; Ray's errors (a dead actor, `timeout_s` passed) as they come."""
        return ray.get(self._system.actor(role).stats.remote(), timeout=timeout_s)

    def mailbox_stats(self, name: str) -> MailboxStats:
        """A mailbox's counters (its depth: `queued`, `leased`), its shards summed."""
        return self._system.mailbox_stats(name)

    def pid(self, role: str) -> int:
        """The process of a role, a generator or a mailbox (one of a single shard)."""
        return ray.get(self._system.actor(role).pid.remote())

    def node_id(self, role: str) -> str:
        """The Ray node a role or a generator runs on."""
        return ray.get(self._system.actor(role).node_id.remote())

    def pids(self) -> dict[str, int]:
        """Every process of the incarnation: the roles by name, `generator-<id>`, `mailbox-<name>`."""
        named = {**{role: role for role in self._system.actors}, **{f"generator-{g}": g for g in self.generator_ids},
                 **{f"mailbox-{name}": f"mailbox-{name}" for name in self._system.mailboxes}}
        calls = {label: self._system.actor(role).pid.remote() for label, role in named.items()}
        return {label: ray.get(ref, timeout=30) for label, ref in calls.items()}

    def kill(self, role: str, restart: bool = False, wait_s: float = 0.0) -> None:
        """Kill a role or a generator as a fault would (`restart`: Ray starts the actor again, as it
        does a reward endpoint's); `wait_s`: up to this long for its loop to end, so that the next
        `check` sees the death."""
        self._system.kill(role, restart, wait_s)

    def inject_generator_fault(self, generator_id: str, **fault: float) -> dict:
        """A generator's engine calls made to hang (`load_hang_s`: its weight loads; `window_hang_s`:
        its windows; 0 ends it): `GeneratorActor.inject_fault`."""
        return ray.get(self._system.generators[generator_id].inject_fault.remote(**fault))

    def reconfigure_reward(self, name: str, settings: dict) -> None:
        """A reward endpoint actor's settings changed in place (e.g. `fault_delay_s`: each call slowed)."""
        ray.get(self._system.actors[f"reward-{name}"].reconfigure.remote(settings))

    def stop(self) -> None:
        if self._system is not None:
            self._system.stop()

    def write_plots(self) -> None:
        self.log.write_plots()


def _cause_message(exc: BaseException) -> str:
    """The message of a role's own error (Ray wraps it with the role's traceback)."""
    return str(exc.cause if isinstance(exc, RayTaskError) else exc)


def _prompt_state(prompts: dict) -> dict:
    """What the prompt source says about why it issues nothing (a stall's first suspect)."""
    return {k: prompts.get(k) for k in ("issued", "budget", "delivered_version", "prompts_retired",
                                        "all_prompts_retired", "all_prompts_exhausted", "reissue_pending")}
