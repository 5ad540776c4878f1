"""The generator pool heals in place (issue 32): a generator killed mid-run is replaced while the
learner keeps training; its work goes back through the ledger, none lost and none trained twice.
A real run on the tiny model, with real actors; the run has no checkpoint, so a whole-system
restart could not happen without failing the test."""

import json
import os
import signal
import time

import psutil
import pytest

from asyncrl.config import compose
from asyncrl.run import Run
from asyncrl.run.pool import autoscale_step, start_refusal

OVERRIDES = ["model=tiny", "task=tiny", "algorithm=grpo", "trainer.wandb_mode=disabled", "trainer.checkpoint_every=0",
             "cluster.num_generators=2", "cluster.generator_timeout_s=30", "algorithm.max_staleness_versions=4"]


def learner_step(run: Run) -> int:
    return run.role_stats("learner")["step"]


def poll_until(run: Run, done, timeout_s: float = 180.0, every_s: float = 0.3) -> list[int]:
    """Poll the run (healing included) until `done()`; the learner's step at each poll."""
    steps, deadline = [], time.time() + timeout_s
    while not done():
        assert time.time() < deadline, f"timed out; steps {steps[-5:]}"
        run.poll()
        steps.append(learner_step(run))
        time.sleep(every_s)
    return steps


def assert_ledger_whole(run: Run) -> None:
    """Learning stopped, every admitted sample is accounted for: none lost, none trained twice."""
    run.stop_learning()
    ledger = run.ledger()
    assert ledger["problems"] == [] and ledger["counts"]["duplicates"] == 0
    assert len(ledger["trained_ids"]) == len(set(ledger["trained_ids"]))


def test_a_killed_generator_is_replaced_while_the_learner_keeps_training(ray_session, tmp_path):
    run = Run(compose([*OVERRIDES, f"trainer.run_dir={tmp_path}"]), str(tmp_path)).start()
    try:
        poll_until(run, lambda: learner_step(run) >= 5)
        os.kill(run.pid("gen-0"), signal.SIGKILL)  # mid-window: the process is gone
        killed_at = learner_step(run)
        steps = poll_until(run, lambda: "gen-2" in run.generator_ids and learner_step(run) >= killed_at + 10)
        assert steps == sorted(steps) and steps[-1] >= killed_at + 10  # never stopped, never went back
        assert run.restarts == []  # healed in place: no restart from a checkpoint
        events = [json.loads(line) for line in open(tmp_path / "generators.jsonl")]
        kinds = [(e["event"], e["generator"]) for e in events]
        assert kinds[:2] == [("removed", "gen-0"), ("joined", "gen-2")], kinds
        assert sorted(run.generator_ids) == ["gen-1", "gen-2"]
        status = run.status()
        bound = run.config.algorithm.max_staleness_versions
        assert all(g["delivered_version"] >= status.weight_version - bound - 1 for g in status.generators)
        assert_ledger_whole(run)
    finally:
        run.stop()


@pytest.mark.slow
def test_a_hung_generator_is_detected_and_replaced(ray_session, tmp_path):
    """A generator that stops answering (its process stopped, as a wedged engine or a half-dead
    node would) is healed after `cluster.generator_timeout_s`: its leases go to the other
    generator, a replacement joins, the learner goes on, and nothing is lost or trained twice."""
    overrides = [o for o in OVERRIDES if not o.startswith("cluster.generator_timeout_s")]
    run = Run(compose([*overrides, "cluster.generator_timeout_s=8", f"trainer.run_dir={tmp_path}"]), str(tmp_path)).start()
    try:
        poll_until(run, lambda: learner_step(run) >= 5)
        victim = run.pid("gen-0")
        os.kill(victim, signal.SIGSTOP)  # alive but silent: only the missing answers can tell
        stopped_at = learner_step(run)
        steps = poll_until(run, lambda: "gen-2" in run.generator_ids and learner_step(run) >= stopped_at + 10)
        assert steps == sorted(steps) and run.restarts == []
        events = [json.loads(line) for line in open(tmp_path / "generators.jsonl")]
        removed = [e for e in events if e["event"] == "removed"]
        # Silent: its stats go unanswered, and the learner's delivery to it times out (the same bound).
        assert [e["generator"] for e in removed] == ["gen-0"], removed
        assert removed[0]["reason"] == "no answer for 8s" or "weight delivery failed" in removed[0]["reason"], removed
        assert sorted(run.generator_ids) == ["gen-1", "gen-2"]
        run.stop_learning()
        ledger = run.ledger()
        assert ledger["problems"] == [] and ledger["counts"]["duplicates"] == 0
    finally:
        try:
            os.kill(victim, signal.SIGCONT)  # if it is still there, let Ray's kill finish it
        except (ProcessLookupError, UnboundLocalError):
            pass
        run.stop()


def test_the_autoscaler_grows_on_a_waiting_learner_and_shrinks_on_waiting_batches():
    """By hand: over half the window waiting for batches grows the pool by one, batches waiting at
    most looks shrink it by one, within [low, high]; neither keeps it (and clamps it into range)."""
    assert autoscale_step(2, 1, 4, learner_waiting=0.6, batches_waiting=0.0) == 3
    assert autoscale_step(4, 1, 4, learner_waiting=0.9, batches_waiting=0.0) == 4  # at the top
    assert autoscale_step(2, 1, 4, learner_waiting=0.1, batches_waiting=0.8) == 1
    assert autoscale_step(1, 1, 4, learner_waiting=0.0, batches_waiting=1.0) == 1  # at the bottom
    assert autoscale_step(3, 1, 4, learner_waiting=0.5, batches_waiting=0.5) == 3  # exactly half: no change
    assert autoscale_step(6, 1, 4, learner_waiting=0.2, batches_waiting=0.2) == 4


def test_a_generator_that_refuses_to_start_is_the_runs_one_line_refusal():
    """Ray keeps only the text of a generator's failed start (its traceback): a `ConfigError` raised
    there (vLLM cannot load the model) comes back as itself, one line, for the CLI to print; any
    other death stays Ray's. `tests/test_vllm_real.py` raises the real one."""
    from ray.exceptions import RayActorError

    from asyncrl.config import ConfigError

    reason = "engine=vllm: vLLM cannot start on the model directory /m: Model architectures ['X'] are not supported"
    died = RayActorError(error_msg="The actor died because of an error raised in its creation task, ray::G.__init__()\n"
                         "  File \"vllm/config/model.py\", line 1\npydantic_core.ValidationError: 1 validation error\n"
                         "  Value error, ...\n\nThe above exception was the direct cause of the following exception:\n"
                         f"  File \"vllm_launch.py\", line 90\nasyncrl.config.checks.ConfigError: {reason}",
                         actor_init_failed=True)
    refused = start_refusal(died)
    assert isinstance(refused, ConfigError) and str(refused) == reason
    assert start_refusal(RayActorError(error_msg=str(died), actor_init_failed=False)) is None  # died later: a heal
    assert start_refusal(RayActorError(error_msg="ValueError: something else", actor_init_failed=True)) is None


@pytest.mark.slow
def test_a_generator_whose_weight_delivery_hangs_while_it_answers_is_healed(ray_session, tmp_path):
    """Issue 44 (1): the one generator's weight load hangs (a wedged engine) while it answers its
    stats. The learner's delivery to it times out and drops it; before, the pool kept it (it
    answered), it went on generating on frozen weights, the learner announced versions nobody held
    and the run stalled for good, every sample stale. Now it is healed (killed: its shared-memory
    mappings go with it) and replaced, the learner goes on, no version is announced beyond what
    the generators hold, and the books balance."""
    overrides = [o for o in OVERRIDES if not o.startswith(("cluster.num_generators", "cluster.generator_timeout_s"))]
    run = Run(compose([*overrides, "cluster.num_generators=1", "cluster.generator_timeout_s=6",
                       f"trainer.run_dir={tmp_path}"]), str(tmp_path)).start()
    announced_beyond = []

    def watch() -> bool:
        status = run.status()
        held = [g["delivered_version"] for g in status.generators if not g.get("unresponsive")]
        if held and status.delivered_version > min(held):
            announced_beyond.append((status.delivered_version, held))
        return "gen-1" in run.generator_ids and status.step >= hung_at + 10

    try:
        poll_until(run, lambda: learner_step(run) >= 5)
        pid = run.pid("gen-0")
        run.inject_generator_fault("gen-0", load_hang_s=3600)
        hung_at = learner_step(run)
        steps = poll_until(run, watch, timeout_s=240)
        assert steps == sorted(steps) and run.restarts == []
        events = [json.loads(line) for line in open(tmp_path / "generators.jsonl")]
        removed = [e for e in events if e["event"] == "removed"]
        assert [e["generator"] for e in removed] == ["gen-0"], events
        assert "weight delivery failed" in removed[0]["reason"] or "engine call" in removed[0]["reason"], removed
        assert not announced_beyond, announced_beyond[:5]
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        run.stop_learning()
        ledger = run.ledger()
        assert ledger["problems"] == [] and ledger["counts"]["duplicates"] == 0
    finally:
        run.stop()
