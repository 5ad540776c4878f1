"""Kill a running system after step k, resume it from its checkpoint, and check that nothing is
counted twice or lost: the real actors, mailboxes, gloo broadcast and files."""

import json
import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.prompt_source import SNAPSHOT_CODEC
from asyncrl.config import compose
from asyncrl.run import Run
from asyncrl.storage import checkpoint, checkpoint_parts


def run_until(run: Run, step: int, timeout_s: float = 240.0) -> list[dict]:
    records, deadline = [], time.time() + timeout_s
    while not records or records[-1]["step"] < step:
        assert time.time() < deadline, f"no step {step} within {timeout_s}s: {run.status().dropped_by_reason}"
        run.check_alive()
        records += run.pop_metrics()
        time.sleep(0.2)
    return records


def read_checkpoint(path: str):
    with open(os.path.join(path, "prompt_source.msgpack"), "rb") as f:
        cursor = SNAPSHOT_CODEC.decode(f.read())
    return cursor, checkpoint_parts.load_json(os.path.join(path, "learner.json"))


@pytest.mark.slow
@pytest.mark.parametrize("setup", [
    # The policy learner sharded over two processes (FSDP2 on gloo): its checkpoint is gathered
    # from both ranks, and the resumed ranks load it (rank 0 reads, the others receive).
    ["task=tiny", "algorithm=grpo", "policy.compute.ranks=2"],
    # Value-based, streaming windows: window rows of unfinished samples, a value learner to restore.
    ["task=tiny_seq", "algorithm=tppo", "engine.window_tokens=2"],
], ids=["grpo", "tppo"])
def test_kill_after_step_k_and_resume(ray_session, tmp_path, setup):
    run_dir = str(tmp_path)
    overrides = ["model=tiny", *setup, "trainer.prompts_per_step=2",
                 "trainer.checkpoint_every=3", "trainer.checkpoint_keep=2", f"trainer.run_dir={run_dir}"]
    first = Run(compose(overrides), run_dir, name_learner=False).start()
    try:
        before = run_until(first, 7)  # checkpoints at steps 3 and 6, then killed mid-stream
    finally:
        first.stop()  # ray.kill of every actor: in-flight work is lost with them
    assert [r["step"] for r in before][:7] == list(range(1, 8))
    root = checkpoint.checkpoints_dir(run_dir)
    steps = [s for s, _ in checkpoint.committed(root)]
    assert steps[-1] >= 6 and steps[-1] % 3 == 0 and len(steps) <= 2  # keep the last 2
    ckpt = checkpoint.latest_valid(run_dir)[0]
    cursor, learner_meta = read_checkpoint(ckpt)
    k = learner_meta["step"]
    assert learner_meta["weight_version"] == k
    trained_at_k = {sid for sid, how in cursor.ledger.ended.items() if how == "trained"}
    open_at_k = list(cursor.ledger.open_samples)
    assert len(trained_at_k) == cursor.ledger.counts["trained"] > 0
    # One Adam step per optimizer update (two per batch for T-PPO's mini-batches; none for a batch
    # whose every token had gone stale), counted by the learner and saved with it.
    updates_at_k = learner_meta["counters"]["optimizer_updates"]
    # (The optimizer state is by parameter name, whole: the same file for any number of ranks.)
    adam = checkpoint_parts.load_tensors(os.path.join(ckpt, "learner.pt"))["optimizer"]["state"]
    assert {int(state["step"]) for state in adam.values()} == {updates_at_k}
    assert 0 < updates_at_k <= k * compose(overrides).policy.mini_batches

    value_version_at_k = None
    if "algorithm=tppo" in setup:
        value_version_at_k = checkpoint_parts.load_json(os.path.join(ckpt, "value", "state.json"))["version"]
        assert value_version_at_k >= 1

    second = Run(compose(overrides + ["resume=true"]), run_dir, name_learner=False).start()
    try:
        assert second.resumed["checkpoint"] == ckpt and second.resumed["step"] == k
        after = run_until(second, k + 6)
        # Step numbering, weight version and the optimizer continue from the checkpoint.
        assert [r["step"] for r in after][:6] == list(range(k + 1, k + 7))
        assert after[0]["weight_version"] == k + 1
        status = second.status()
        # The generators got the checkpoint's weights before their first prompt: nothing is older.
        assert all(g["delivered_version"] >= k for g in status.generators)
        assert max(r["staleness_max"] for r in after) <= compose(overrides).algorithm.max_staleness_versions
        learner = second.role_stats("learner")
        # Adam's count continues from the checkpoint's (a fresh optimizer would restart at 0).
        assert learner["optimizer_steps"] == learner["optimizer_updates"] > updates_at_k and learner["incarnation"] == 1
        if value_version_at_k is not None:  # the value learner continues from its saved version
            assert status.value_learner["value_version"] >= value_version_at_k
        # The prompt cursor continues: the resumed run issues prompts after the saved position.
        prompts = second.role_stats("prompt_source")
        assert prompts["issued"] > cursor.issued
        assert (prompts["epoch"], prompts["index"]) > (cursor.epoch, cursor.index)
        # No sample trained twice: the ledger carries the checkpoint's trained ids and would
        # count a second training of any of them.
        time.sleep(1.0)
        ledger = second.ledger()
        assert ledger["problems"] == [], ledger["problems"]
        assert ledger["counts"]["duplicates"] == 0
        trained_now = set(ledger["trained_ids"])
        assert trained_at_k <= trained_now
        assert ledger["counts"]["trained"] == len(trained_now)
        # Nothing lost: every sample open at the checkpoint was regenerated (or its saved batch
        # trained) and has ended, or is still moving through the pipeline.
        deadline = time.time() + 120
        while True:
            states = second.sample_states(open_at_k)
            assert None not in states.values()
            if all(s in ("trained", "dropped") for s in states.values()) or time.time() > deadline:
                break
            second.pop_metrics()
            time.sleep(0.5)
        assert all(s in ("trained", "dropped") for s in states.values()), states
        print(f"resumed at step {k}: {len(open_at_k)} samples open at the checkpoint, "
              f"{sum(s == 'trained' for s in states.values())} trained after resume, {second.resumed}")
        ledger = second.ledger()
        assert ledger["problems"] == [] and ledger["counts"]["duplicates"] == 0
        # Every rank of a sharded learner took every step (its own shard of Adam's state): read
        # once the learner's loop has ended, so no step is between the reads.
        second.stop_learning()
        learner = second.role_stats("learner")
        ranks = [second.role_stats(name) for name in second.role_names if name.startswith("learner-rank")]
        assert len(ranks) == (1 if "policy.compute.ranks=2" in setup else 0)
        assert all(rank["optimizer_steps"] == learner["optimizer_steps"] for rank in ranks)
    finally:
        second.stop()


@pytest.mark.slow
def test_checkpoint_exports_a_hugging_face_directory(ray_session, tmp_path):
    run_dir = str(tmp_path / "run")
    config = compose(["model=tiny", "task=tiny", "algorithm=grpo", "trainer.prompts_per_step=2",
                      "trainer.checkpoint_every=2", f"trainer.run_dir={run_dir}"])
    run = Run(config, run_dir, name_learner=False).start()
    try:
        run_until(run, 2)
        run.stop_learning()  # no step between the two reads below
        path = run.checkpoint()  # on demand (the admin route does the same)
        version, weights = run.weights()
    finally:
        run.stop()
    out = checkpoint_parts.export_hf(path, str(tmp_path / "hf"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    # Every exported file gets the same default mode (safetensors' temporary file was 0600).
    assert {os.stat(os.path.join(out, f)).st_mode & 0o777 for f in os.listdir(out)} == {0o666 & ~_umask()}
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("3+4=", return_tensors="pt").input_ids
    assert ids.shape[1] == 4  # the character-level tokenizer came along
    state = dict(model.named_parameters())
    # The exported weights are the learner's at the checkpoint.
    assert version == checkpoint_parts.load_json(os.path.join(path, "learner.json"))["weight_version"] >= 2
    for name, tensor in weights.items():
        assert torch.equal(state[name].detach(), tensor), name


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_restart_budget_counts_a_window_not_the_runs_life():
    """Issue 44 (4): three restarts a week apart used to end a run at the fourth fault
    (`max_restarts` per life). Now `max_restarts` counts the last `restart_window_s` only; when
    spent, it says when the next is allowed; 0 restarts allowed is never."""
    from asyncrl.run import restart_allowed_at

    hour, day = 3600.0, 86400.0
    week = [0.0, 2 * day, 4 * day]  # three restarts over four days
    assert restart_allowed_at(week, now=6 * day, max_restarts=3, window_s=hour) is None
    burst = [6 * day, 6 * day + 60, 6 * day + 120]  # three in two minutes
    assert restart_allowed_at(week + burst, now=6 * day + 180, max_restarts=3, window_s=hour) == 6 * day + hour
    assert restart_allowed_at(week + burst, now=6 * day + hour + 1, max_restarts=3, window_s=hour) is None
    assert restart_allowed_at([], now=0.0, max_restarts=0, window_s=hour) == float("inf")


@pytest.mark.slow
def test_every_error_of_a_poll_restarts_the_run_and_a_spent_budget_says_when_it_may_again(ray_session, tmp_path):
    """Issue 44 (4): an error raised in a poll outside the deaths `check_alive` sees (reading the
    metrics, the status, healing the pool) escaped `Run.poll` and ended the run (under Serve the
    controller was replaced and a fresh run began). Now it restarts the run from its checkpoint,
    within the budget of the window; past it, `RestartBudgetSpent` names when the next restart is
    allowed, and a later `Run` on the same directory (a replaced controller) counts those restarts."""
    from asyncrl.run import RestartBudgetSpent

    overrides = ["model=tiny", "task=tiny", "algorithm=grpo", "trainer.prompts_per_step=2", "trainer.checkpoint_every=2",
                 "trainer.max_restarts=1", "trainer.restart_window_s=600", "trainer.wandb_mode=disabled",
                 f"trainer.run_dir={tmp_path}"]
    run = Run(compose(overrides), str(tmp_path)).start()
    try:
        deadline = time.time() + 180
        while run.step < 4 or checkpoint.latest_valid(str(tmp_path))[0] is None:
            assert time.time() < deadline and run.poll().restart is None
            time.sleep(0.2)
        run.inject_poll_errors = 1
        polled = run.poll()
        assert polled.restart is not None and "InjectedFault" in polled.restart["reason"]
        assert polled.restart["step"] >= 2 and run.restarts == [polled.restart]
        while run.step < polled.restart["step"] + 2:  # it trains again
            assert time.time() < deadline and run.poll().restart is None
            time.sleep(0.2)
        run.inject_poll_errors = 1
        with pytest.raises(RestartBudgetSpent) as spent:
            run.poll()
        first_at = json.loads(open(tmp_path / "restarts.jsonl").readline())["at"]
        assert abs(spent.value.retry_at - (first_at + 600)) < 1 and "InjectedFault" in spent.value.reason
    finally:
        run.stop()
    later = Run(compose(overrides), str(tmp_path))  # e.g. the Serve controller that replaces this one
    assert later.restart_times == [first_at]  # the refused restart spent nothing
