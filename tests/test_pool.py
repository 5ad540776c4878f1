"""The generator pool heals in place (issue 32): a generator killed mid-run is replaced while the
learner keeps training; its work goes back through the ledger, none lost and none trained twice.
A real run on the tiny model, with real actors; the run has no checkpoint, so a whole-system
restart could not happen without failing the test."""

import json
import os
import signal
import time

import ray

from asyncrl.config import compose
from asyncrl.run import Run

OVERRIDES = ["model=tiny", "task=tiny", "algorithm=grpo", "trainer.wandb_mode=disabled", "trainer.checkpoint_every=0",
             "cluster.num_generators=2", "cluster.generator_timeout_s=30", "algorithm.max_staleness_versions=4"]


def learner_step(run: Run) -> int:
    return ray.get(run.system.actors["learner"].stats.remote())["step"]


def poll_until(run: Run, done, timeout_s: float = 180.0, every_s: float = 0.3) -> list[int]:
    """Poll the run (healing included) until `done()`; the learner's step at each poll."""
    steps, deadline = [], time.time() + timeout_s
    while not done():
        assert time.time() < deadline, f"timed out; steps {steps[-5:]}"
        run.poll()
        steps.append(learner_step(run))
        time.sleep(every_s)
    return steps


def test_a_killed_generator_is_replaced_while_the_learner_keeps_training(ray_session, tmp_path):
    run = Run(compose([*OVERRIDES, f"trainer.run_dir={tmp_path}"]), str(tmp_path)).start()
    try:
        poll_until(run, lambda: learner_step(run) >= 5)
        victim = run.system.generators["gen-0"]
        os.kill(ray.get(victim.pid.remote()), signal.SIGKILL)  # mid-window: the process is gone
        killed_at = learner_step(run)
        steps = poll_until(run, lambda: "gen-2" in run.system.generators and learner_step(run) >= killed_at + 10)
        assert steps == sorted(steps) and steps[-1] >= killed_at + 10  # never stopped, never went back
        assert run.restarts == []  # healed in place: no restart from a checkpoint
        events = [json.loads(line) for line in open(tmp_path / "generators.jsonl")]
        kinds = [(e["event"], e["generator"]) for e in events]
        assert kinds[:2] == [("removed", "gen-0"), ("joined", "gen-2")], kinds
        assert sorted(run.system.generators) == ["gen-1", "gen-2"]
        status = run.system.status()
        bound = run.config.algorithm.max_staleness_versions
        assert all(g["delivered_version"] >= status["weight_version"] - bound - 1 for g in status["generators"])
        run.system.stop_learning()
        ledger = run.system.ledger()
        assert ledger["problems"] == [] and ledger["counts"]["duplicates"] == 0
        assert len(ledger["trained_ids"]) == len(set(ledger["trained_ids"]))
    finally:
        run.stop()
