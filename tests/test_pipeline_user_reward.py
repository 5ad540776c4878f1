"""The user's own reward and data through the real pipeline: a reward file written for verl, then one
written for TRL, train the tiny model on its task from a parquet file the user wrote; a function
that fails in every way leaves the run whole; the held-out accuracy is measured with the user's reward."""

import json

import numpy as np
import pytest

from asyncrl.config import compose
from asyncrl.driver import train
from asyncrl.storage.trajectory_store import read_trajectories

VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str[:1] == ground_truth
    return {"score": float(right), "acc": right, "digit": float(solution_str[:1].isdigit())}
'''
TRL_REWARD = '''
def first_digit(prompts, completions, answer, **columns):
    return [float(c[:1] == str(a)) for c, a in zip(completions, answer)]
'''
# Each fault on the samples of one prompt (by its answer): a group with a failed reward is dropped
# whole, so faults on every prompt would leave nothing to train on; here five prompts train.
FAULTY_REWARD = '''
import math, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "1":
        raise RuntimeError("the user's function broke")
    if ground_truth == "2":
        time.sleep(30)
    if ground_truth == "3":
        return math.nan
    if ground_truth == "4":
        return None
    if ground_truth == "5":
        return "a string"
    return float(solution_str[:1] == ground_truth)
'''
# The tiny task's settings (model, lengths, lr, G), its prompts read from the user's file instead.
TINY = ["model=tiny", "task=tiny", "task.name=file", "algorithm=grpo", "trainer.wandb_mode=disabled",
        "trainer.checkpoint_every=0"]


def write_data(tmp_path, layout: str) -> None:
    """The tiny task ("d:" -> the next digit) as the user's parquet files: verl's layout (data
    source "mine", so no built-in verifier knows it) or TRL's (`prompt` text, `answer`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split in ("train", "test"):
        if layout == "verl":
            rows = [{"data_source": "mine", "prompt": [{"role": "user", "content": f"{d}:"}],
                     "reward_model": {"ground_truth": str((d + 1) % 10)}, "extra_info": {"index": d}} for d in range(10)]
        else:
            rows = [{"prompt": f"{d}:", "answer": (d + 1) % 10} for d in range(10)]  # an int answer
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{split}.parquet")


def user_run(tmp_path, layout: str, reward: str, *overrides: str) -> dict:
    write_data(tmp_path, layout)
    (tmp_path / "reward.py").write_text(reward)
    config = compose(TINY + [f"task.path={tmp_path}/train.parquet", f"task.eval_path={tmp_path}/test.parquet",
                             f"trainer.run_dir={tmp_path}/run", *overrides])
    return train(config, progress=False, eval_prompts=10)


def test_a_reward_file_written_for_verl_trains_the_tiny_model(ray_session, tmp_path):
    summary = user_run(tmp_path, "verl", VERL_REWARD, f"custom_reward_function.path={tmp_path}/reward.py",
                       "trainer.total_steps=400", "trainer.target_reward=0.9")
    assert summary["reached_target"], [r["reward_mean_generated"] for r in summary["records"][-20:]]
    # Held out, scored by the user's function: no built-in verifier knows data source "mine".
    assert summary["eval_after"]["accuracy"] >= 0.9 > summary["eval_before"]["accuracy"]
    assert summary["final_status"]["reward_endpoints"]["custom"]["signature"] == "verl"
    # The function's other numbers, averaged per data source, are in the step records.
    assert 0.0 <= summary["records"][-1]["reward_extra/mine/digit"] <= 1.0
    assert summary["final_status"]["ledger"]["problems"] == []


@pytest.mark.slow  # (CI's time: a TRL function's calls in tests/test_user_reward.py; a user's function trains in the verl test above)
def test_a_reward_function_written_for_trl_trains_the_tiny_model(ray_session, tmp_path):
    summary = user_run(tmp_path, "trl", TRL_REWARD, "+reward.endpoints.mine={kind: python, path: "
                       f"{tmp_path}/reward.py, function: first_digit}}", "reward.routes=[{match: '*', endpoints: [mine]}]",
                       "task.answer_key=answer", "trainer.total_steps=400", "trainer.target_reward=0.9")
    assert summary["reached_target"], [r["reward_mean_generated"] for r in summary["records"][-20:]]
    assert summary["eval_after"]["accuracy"] >= 0.9 > summary["eval_before"]["accuracy"]
    assert summary["final_status"]["reward_endpoints"]["mine"]["signature"] == "trl"


@pytest.mark.slow  # (CI's time: each fault is a failed reward with its reason in tests/test_user_reward.py)
def test_a_reward_function_that_fails_every_way_leaves_the_run_whole(ray_session, tmp_path):
    """It raises, hangs past its timeout, returns NaN, None and a string: each is a failed reward
    with its reason in the store, counted by its endpoint; the run reaches its last step and the
    ledger balances."""
    summary = user_run(tmp_path, "verl", FAULTY_REWARD, f"custom_reward_function.path={tmp_path}/reward.py",
                       "reward.endpoints.custom.call_timeout_s=1", "reward.endpoints.custom.workers=4",
                       "trainer.total_steps=4", "trainer.store_trajectories=true")
    assert summary["steps"] == 4
    status = summary["final_status"]
    assert status["ledger"]["problems"] == [] and status["reward_endpoints"]["custom"]["failed"] > 0
    reasons = {r.reward_error for r in read_trajectories(tmp_path / "run") if r.reward_failed}
    for expected in ("RuntimeError: the user's function broke", "ran past 1 s (killed)", "nan, not a finite number",
                     "None, not a finite number", "'a string', not a finite number"):
        assert any(expected in reason for reason in reasons), (expected, reasons)
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(lines) == 4 and np.isfinite([r["loss"] for r in lines]).all()


ROW_ONLY_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # The answer is in the row alone (the ground truth column is a decoy): a row that did not
    # arrive is a KeyError, a failed reward, and the run stops.
    assert len(extra_info["reference"]) == 1 << 20
    return float(solution_str[:1] == extra_info["next"])
'''


@pytest.mark.slow  # (CI's time: a reward call carries each prompt's row once, below)
def test_a_prompts_row_reaches_its_reward_once_per_prompt_not_with_every_sample(ray_session, tmp_path):
    """Rows of 1 MB each (a long reference text): the reward function reads the answer from its
    row, which the assembler fetched from the prompt source once per prompt; segments, batches
    and the prompts mailbox carry none (their mailboxes hold kilobytes, not G megabytes a prompt)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "mine", "prompt": [{"role": "user", "content": f"{d}:"}],
             "reward_model": {"ground_truth": "x"},
             "extra_info": {"next": str((d + 1) % 10), "reference": "r" * (1 << 20)}} for d in range(10)]
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{split}.parquet")
    (tmp_path / "reward.py").write_text(ROW_ONLY_REWARD)
    config = compose(TINY + [f"task.path={tmp_path}/train.parquet", f"task.eval_path={tmp_path}/test.parquet",
                             f"trainer.run_dir={tmp_path}/run", f"custom_reward_function.path={tmp_path}/reward.py",
                             "trainer.total_steps=3"])
    summary = train(config, progress=False, eval_prompts=4)
    status = summary["final_status"]
    assert summary["steps"] == 3 and status["assembler"]["reward_failures"] == 0
    scored, fetched = status["assembler"]["samples_scored"], status["assembler"]["prompt_rows_fetched"]
    issued = status["prompt_source"]["issued"]
    assert 0 < fetched <= issued and fetched * 4 < scored, (fetched, issued, scored)  # per prompt, not per sample
    peak = max(box["bytes_peak"] for box in status["queue_depths"].values())
    assert peak < 1 << 20, status["queue_depths"]  # no mailbox ever held a row


def test_a_reward_call_carries_each_prompts_row_once_whatever_its_group_size(ray_session):
    """The assembler's requests for one call (`PromptRows.fill`) share their prompt's row, and Ray's
    serializer (what `endpoint.score.remote` sends) writes a shared object once: a call of 2 prompts
    x 16 samples with 1 MB rows is 2 MB on the wire, not 32, and the endpoint holds one row per prompt."""
    import asyncio

    import ray

    from asyncrl.assembly.prompt_rows import PromptRows
    from asyncrl.messages.structs import RewardRequest

    rows = {pid: {"extra_info": {"reference": pid * (1 << 20)}} for pid in ("a", "b")}
    fetches: list[list[str]] = []

    async def rows_of(ids):
        fetches.append(ids)
        return {pid: rows[pid] for pid in ids}

    requests = [RewardRequest(prompt_id=pid, sample_idx=i, response_text="1", ground_truth="1", data_source="mine")
                for pid in ("a", "b") for i in range(16)]
    filled = asyncio.run(PromptRows(rows_of).fill(requests))
    assert fetches == [["a", "b"]] and all(r.row is rows[r.prompt_id] for r in filled)
    wire = ray._private.worker.global_worker.get_serialization_context().serialize(filled).total_bytes
    assert 2 << 20 < wire < (2 << 20) + (64 << 10), wire

    @ray.remote(num_cpus=0)
    def distinct_rows_held(received):
        return len({id(r.row) for r in received}), len({r.row["extra_info"]["reference"][:1] for r in received})

    assert ray.get(distinct_rows_held.remote(filled)) == (2, 2)
