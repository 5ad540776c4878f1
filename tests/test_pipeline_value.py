"""Value-based algorithms through the real pipeline (Ray actors, value learner, gloo broadcast)."""

import json

import numpy as np
import pytest

from asyncrl.config import compose
from asyncrl.driver import train


def run(tmp_path, overrides):
    config = compose(["model=tiny", "task=tiny_seq", f"trainer.run_dir={tmp_path}", "trainer.wandb_mode=disabled",
                      *overrides])
    summary = train(config, progress=False)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    return config, summary, records


@pytest.mark.slow
def test_tppo_learns_a_task_whose_answer_spans_windows(ray_session, tmp_path):
    # "d:" -> three digits with 2-token windows: the first window is trained before the response
    # is finished (EGAE bootstrap), the reward only exists on the second.
    config, summary, records = run(tmp_path, ["algorithm=tppo", "trainer.total_steps=150"])
    rewards = np.array([r["reward_mean_generated"] for r in records])
    # Chance is about 1/30 per digit; the partial-credit reward must clearly rise (steps 110-150 of
    # three seeds: 0.19-0.24, from 0.03).
    assert rewards[:20].mean() < 0.08, rewards[:20]
    assert rewards[-40:].mean() > rewards[:20].mean() + 0.05, (rewards[:20].mean(), rewards[-40:].mean())

    # Windows were trained while their responses were still being written.
    assert min(r["finished_row_fraction"] for r in records) < 1.0
    assert all(r["rows_trained"] > 0 for r in records)
    status = summary["final_status"]
    value = status["value_learner"]
    assert value["value_steps"] >= config.critic.warmup.steps and value["duplicate_trajectories"] == 0
    # Nothing was trained before the critic's warm-up; those rows are counted, not lost silently.
    assert status["assembler"]["dropped_value_warmup_rows"] > 0
    assert all(r["value_version_min"] >= config.critic.warmup.steps for r in records)
    assert status["assembler"].get("duplicate_segments", 0) == 0
    assert max(r["staleness_max"] for r in records) <= config.algorithm.max_staleness_versions
    assert "value_loss" in records[-1] and "value_explained_variance" in records[-1]
    # The ledger balances with windows too (a sample ends when its last window trains or drops).
    assert status["ledger"]["problems"] == [] and status["ledger"]["dropped_by_reason"].get("value_warmup", 0) > 0


@pytest.mark.slow
def test_synchronous_baseline_trains_only_on_current_weights(ray_session, tmp_path):
    # The baseline of the async-vs-sync benchmark: one window per response (W = L_max), the next
    # batch generated only after the new weights reached the generator.
    config, summary, records = run(tmp_path, ["algorithm=tppo_sync", "engine.window_tokens=4", "trainer.total_steps=12"])
    assert config.trainer.synchronous and config.algorithm.max_staleness_versions == 0
    assert len(records) >= 12
    assert all(r["staleness_mean"] == 0 and r["staleness_max"] == 0 for r in records)
    assert all(r["finished_row_fraction"] == 1.0 for r in records)  # nothing is cut at W = L_max
    # Every step trains exactly prompts_per_step * G samples.
    n = config.trainer.prompts_per_step * config.algorithm.group_size
    assert all(r["rows_trained"] == n for r in records)
    assert records[-1]["samples_trained"] == n * len(records)
    assert summary["final_status"]["assembler"].get("dropped_stale_rows", 0) == 0
