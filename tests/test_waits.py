"""Waits with an end: a role that stays alive but stops answering (SIGSTOP: a wedged process) is
treated as dead after its bound, and the run restarts from its checkpoint instead of hanging."""

import os
import signal
import threading
import time

import pytest
import ray

from asyncrl.config import compose
from asyncrl.run import Run
from asyncrl.run import deadlines


def test_a_call_that_outlives_its_bound_names_the_role(ray_session):
    @ray.remote(num_cpus=0)
    class Wedged:
        def stats(self):
            time.sleep(30)

    actor = Wedged.remote()
    start = time.monotonic()
    with pytest.raises(deadlines.RoleHung, match="the assembler did not answer stats within 1s"):
        deadlines.answer(actor.stats.remote(), "the assembler", "stats", timeout_s=1.0)
    assert time.monotonic() - start < 5
    ray.kill(actor)


@pytest.mark.slow
@pytest.mark.parametrize("generator_killed", [False, True])
def test_a_hung_role_restarts_the_run_instead_of_hanging_it(ray_session, tmp_path, monkeypatch, generator_killed):
    """The assembler stopped; with `generator_killed` a generator is killed at the same moment, so
    the pool heals it while the assembler cannot answer its retirement (that wait had no end)."""
    monkeypatch.setattr(deadlines, "CONTROL_TIMEOUT_S", 5.0)
    run_dir = str(tmp_path)
    config = compose(["model=tiny", "task=tiny", "algorithm=grpo", "trainer.prompts_per_step=2",
                      "trainer.checkpoint_every=2", f"trainer.run_dir={run_dir}"])
    run = Run(config, run_dir).start()
    stopped = None
    try:
        deadline = time.time() + 240
        while run.step < 3:
            assert time.time() < deadline
            run.poll()
            time.sleep(0.2)
        stopped = run.pid("assembler")
        if generator_killed:  # dead before the assembler stops: the next poll heals it first
            run.kill(run.generator_ids[0], wait_s=60)
        os.kill(stopped, signal.SIGSTOP)  # alive to Ray, answering nothing
        stopped_at = time.time()
        polls: list = []

        def poll_until_restart():
            while time.time() < deadline:
                polled = run.poll()
                if polled.restart is not None:
                    polls.append(polled.restart)
                    return
                time.sleep(0.2)

        watcher = threading.Thread(target=poll_until_restart, daemon=True)
        watcher.start()
        watcher.join(timeout=200)
        assert not watcher.is_alive(), "the run's poll hung on the stuck role"
        assert polls and "RoleHung" in polls[0]["reason"] and "assembler" in polls[0]["reason"], polls
        if generator_killed:
            assert "retire_generator" in polls[0]["reason"], polls
        assert time.time() - stopped_at < 120  # the bound (5 s), a restart's start, a loaded machine
        assert polls[0]["step"] >= 2 and run.ledger()["counts"]["admitted"] >= 0  # the new system answers
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        run.stop()
