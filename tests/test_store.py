"""The trajectory store and its seams (issue 17): files that other tools read, records that replay as
the generator's windows, golden batches that pin the policy step's maths, and the recording and
offline modes through the real actors."""

import json
import os
import subprocess
import sys
import time

import msgspec
import numpy as np
import pyarrow.parquet as pq
import pytest

from asyncrl.assembly.rows import merge_segments
from asyncrl.config import compose, config_from_dict
from asyncrl.messages.structs import FinishReason, Reward, Segment, float32_array, int32_array
from asyncrl.offline import replay_batch
from asyncrl.storage.trajectory_store import (BATCH_RECORD_DECODER, TRAJECTORY_SCHEMA, StoreWriter, read_batches, read_trajectories,
                                              record_of, reward_of, segments_of, store_files)

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")


def window(turn, new, prior=(), finished=False, versions=None):
    n = len(new)
    return Segment(prompt_id="p@0", sample_idx=1, window=turn, group_id="p@0", group_size=2,
                   prompt_token_ids=int32_array([5, 6]), prior_response_ids=int32_array(list(prior)),
                   prior_versions=int32_array([0] * len(prior)), new_token_ids=int32_array(new),
                   new_logprobs=float32_array([-0.5 * (turn + 1)] * n),
                   new_versions=int32_array(versions or [turn] * n), finished=finished,
                   finish_reason=FinishReason.EOS if finished else FinishReason.WINDOW, data_source="tiny",
                   ground_truth="7", seed=11, generator_id="gen-0")


def test_records_replay_as_the_windows_they_came_from():
    parts = [window(0, [1, 2]), window(1, [3], prior=[1, 2]), window(2, [4, 5], prior=[1, 2, 3], finished=True)]
    merged = merge_segments(parts)
    reward = Reward(prompt_id="p@0", sample_idx=1, score=1.0, source="verifier", source_version="verifier:v:2",
                    correct=True, token_rewards=float32_array([0.1] * 5))
    record = record_of(merged, [2, 3, 5], reward, "5 6", "1 2 3 4 5", "kept", values=np.zeros(5))
    assert record.window_ends == [2, 3, 5] and record.token_versions == [0, 0, 1, 2, 2]
    again = segments_of(msgspec.convert(msgspec.to_builtins(record), type(record)))
    assert [(s.window, s.new_token_ids.tolist(), s.finished) for s in again] == \
        [(0, [1, 2], False), (1, [3], False), (2, [4, 5], True)]
    assert again[2].prior_response_ids.tolist() == [1, 2, 3] and again[1].new_logprobs.tolist() == [-1.0]
    back = reward_of(record)
    assert (back.score, back.correct, back.source_version) == (1.0, True, "verifier:v:2")
    assert back.token_rewards.tolist() == pytest.approx([0.1] * 5)


def test_files_roll_by_size_and_age_and_readers_see_only_closed_ones(tmp_path):
    merged = merge_segments([window(0, [1, 2, 3], finished=True)])
    row = msgspec.structs.asdict(record_of(merged, [3], None, "p", "r", "dropped", "no_signal"))
    writer = StoreWriter(str(tmp_path), "trajectories", TRAJECTORY_SCHEMA, max_file_bytes=1, max_file_age_s=1e9)
    writer.append([row] * 3)
    writer.flush()  # past 1 byte: closed and renamed at once
    assert len(store_files(str(tmp_path))) == 1
    aged = StoreWriter(str(tmp_path), "trajectories", TRAJECTORY_SCHEMA, max_file_bytes=1 << 30, max_file_age_s=0.2)
    aged.append([row])
    aged.flush()
    assert len(store_files(str(tmp_path))) == 1  # the second file is still being written: not read
    assert any(name.endswith(".inprogress") for name in os.listdir(tmp_path))
    time.sleep(0.25)
    aged.append([row])
    aged.flush()  # old enough: closed
    assert len(store_files(str(tmp_path))) == 2
    records = read_trajectories(str(tmp_path))
    assert len(records) == 5 and {r.drop_reason for r in records} == {"no_signal"}
    assert read_trajectories(str(tmp_path), ("kept",)) == []


@pytest.mark.parametrize("name", ["grpo", "dapo", "vapo"])
def test_a_golden_batch_reproduces_its_recorded_loss_and_gradient_norm(name):
    """Recorded by `load_tests/golden_batches.py`: the first batch of a tiny run and what the learner
    got on it. The same batch at the same weights must give the same numbers; a change of the maths
    (here: another loss aggregation) must not."""
    config = config_from_dict(json.load(open(os.path.join(GOLDEN, name, "config.json"))))
    with open(os.path.join(GOLDEN, name, "batch.msgpack"), "rb") as f:
        record = BATCH_RECORD_DECODER.decode(f.read())
    metrics = replay_batch(config, record)
    assert metrics["loss"] == pytest.approx(record.loss, rel=1e-4, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(record.grad_norm, rel=1e-4)
    other = "seq-mean-token-sum" if config.policy.loss.agg == "token-mean" else "token-mean"
    config.policy.loss.agg = other
    changed = replay_batch(config, record)
    assert changed["grad_norm"] != pytest.approx(record.grad_norm, rel=1e-3)


def read_without_asyncrl(store: str) -> dict:
    """pyarrow, pandas and Hugging Face datasets read the store in a process that never imports asyncrl."""
    script = f"""
import glob, json, sys
import pandas, pyarrow.parquet as pq, datasets
files = sorted(glob.glob({os.path.join(store, 'trajectories-*.parquet')!r}))
table = pq.read_table(files[0])
frame = pandas.read_parquet(files)
data = datasets.load_dataset("parquet", data_files=files, split="train")
row = data[0]
print(json.dumps({{"rows": len(frame), "datasets_rows": len(data), "columns": list(frame.columns),
                  "tokens_match": row["response_token_ids"] == frame.iloc[0]["response_token_ids"].tolist(),
                  "asyncrl_imported": any(m.startswith("asyncrl") for m in sys.modules)}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd="/", env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_recorded_run_is_read_elsewhere_replayed_and_learned_from_offline(solved_dapo_run, tmp_path):
    from asyncrl.storage.checkpoint_parts import policy_dir
    from asyncrl.models.loading import build_tiny_tokenizer, value_model_from_checkpoint
    from asyncrl.offline import learn

    _, summary, run = solved_dapo_run  # DAPO until solved, recorded: kept and no-signal groups
    ledger = summary["final_status"]["ledger"]
    records = read_trajectories(str(run))
    # Every sample the assembler finished with is in the store, kept or dropped with its reason (the
    # ledger was read at the last step; the run went on for a moment until it stopped).
    by_status = {s: sum(r.status == s for r in records) for s in ("kept", "dropped")}
    assert by_status["dropped"] >= ledger["dropped"] > 0
    assert by_status["kept"] >= ledger["trained"] > 0
    assert {r.drop_reason for r in records if r.status == "dropped"} == set(ledger["dropped_by_reason"])
    kept = next(r for r in records if r.status == "kept")
    assert len(kept.behaviour_logprobs) == len(kept.token_versions) == len(kept.response_token_ids)
    assert kept.reward_source == "verifier" and kept.reward_version and kept.score is not None
    assert len({r.sample_id for r in records}) == len(records)
    # Readable without asyncrl, and the same rows every way.
    seen = read_without_asyncrl(str(run / "trajectories"))
    assert seen["rows"] == seen["datasets_rows"] == len(records) and not seen["asyncrl_imported"]
    assert seen["tokens_match"] and set(TRAJECTORY_SCHEMA.names) <= set(seen["columns"])
    # Learner-only replay of the first batch gives the recorded numbers.
    batches = read_batches(str(run))
    steps = [b.step for b in batches]
    assert steps == sorted(steps) and len(steps) == len(set(steps)) >= 3
    metrics = replay_batch(config_from_dict(json.load(open(run / "config.json"))), batches[0])
    assert metrics["loss"] == pytest.approx(batches[0].loss, rel=1e-4, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(batches[0].grad_norm, rel=1e-4)

    # Offline: DQO from the store, then value pretraining; both leave checkpoints an online run uses.
    dqo = learn(compose(["model=tiny", "task=tiny", "algorithm=dqo", "mode=learn", f"offline.data={run}",
                         "trainer.total_steps=4", f"trainer.run_dir={tmp_path / 'dqo'}"]), progress=False)
    assert dqo["steps"] == 4 and dqo["trajectories"] == len([r for r in records if r.score is not None])
    assert os.path.exists(os.path.join(policy_dir(dqo["last_checkpoint"]), "model.safetensors"))
    dqo_metrics = [json.loads(line) for line in open(tmp_path / "dqo" / "metrics.jsonl")]
    assert len(dqo_metrics) == 4 and all(np.isfinite(m["dqo_policy_loss"]) for m in dqo_metrics)
    value = learn(compose(["model=tiny", "task=tiny", "algorithm=vcppo", "mode=learn", "offline.train=value",
                           f"offline.data={run}", "offline.batch_trajectories=128", "critic.optimizer.lr=1e-3",
                           "trainer.total_steps=2", f"trainer.run_dir={tmp_path / 'value'}"]), progress=False)
    assert value["steps"] == 2
    critic = value_model_from_checkpoint(value["value_init_path"], compose(["model=tiny"]).model, build_tiny_tokenizer())
    assert float(critic.head.bias.abs().sum()) > 0  # trained towards the returns (a fresh head is zero)
    # Replay through the algorithm's own learner and the real assembler, with the recorded rewards.
    replayed = learn(compose(["model=tiny", "task=tiny", "algorithm=grpo", "mode=learn", f"offline.data={run}",
                              "trainer.total_steps=2", f"trainer.run_dir={tmp_path / 'replay'}"]), progress=False)
    assert replayed["steps"] == 2 and replayed["assembler"]["groups_closed"] >= 2


@pytest.mark.slow
def test_generate_mode_records_every_sample_and_trains_nothing(ray_session, tmp_path):
    from asyncrl.offline import generate_and_store

    config = compose(["model=tiny", "task=tiny", "algorithm=grpo", "mode=generate", "trainer.store_trajectories=true",
                      "trainer.total_steps=2", "trainer.wandb_mode=disabled", f"trainer.run_dir={tmp_path}"])
    summary = generate_and_store(config, progress=False)
    expected = 2 * config.trainer.prompts_per_step * config.algorithm.group_size
    assert summary["samples_recorded"] == expected and summary["ledger_problems"] == []
    records = read_trajectories(str(tmp_path))
    assert len(records) == expected and {r.status for r in records} == {"recorded"}
    assert {v for r in records for v in r.token_versions} == {0}  # no learner: the initial weights only
    assert not os.path.exists(tmp_path / "checkpoints") and store_files(str(tmp_path), "batches") == []
    assert pq.read_table(store_files(str(tmp_path))[0]).num_rows > 0
