"""Every algorithm preset learns the tiny task through the real actors (issue 62): from chance to a
20-step rolling reward of 0.9 and 0.9 held-out within 400 steps, each with its own preset and the
task's settings (`configs/task/tiny.yaml`). The value-based ones also show their critic learned:
its explained variance over the last batches (`value_explained_variance_window`) rises (0.40-0.88
at its best over the seeds measured), and it learns on samples of the policy's recent versions.
CI runs PPO; `make test-slow` runs them all (docs/results.md, "Every preset on the tiny task")."""

import pytest

from asyncrl.config import compose
from asyncrl.driver import train

# Pairwise PPO learns it with the rule verifier as its judge (the tiny random model cannot judge):
# tests/test_pipeline_rewards.py::test_pairwise_ppo_with_the_verifier_as_judge_learns_the_tiny_task.
PRESETS = {"ppo": [], "vcppo": [], "vapo": [], "tppo": [], "grpo": [], "dapo": [], "rloo": [],
           "reinforce_plus_plus": []}
VALUE_BASED = {"ppo", "vcppo", "vapo", "tppo"}


@pytest.mark.parametrize("algorithm", [pytest.param(name, marks=() if name == "ppo" else pytest.mark.slow)
                                       for name in PRESETS])
def test_every_preset_learns_the_tiny_task(ray_session, tmp_path, algorithm):
    config = compose(["model=tiny", "task=tiny", f"algorithm={algorithm}", *PRESETS[algorithm],
                      "trainer.total_steps=400", "trainer.target_reward=0.9", f"trainer.run_dir={tmp_path}",
                      "trainer.wandb_mode=disabled", "trainer.checkpoint_every=0"])
    summary = train(config, progress=False, eval_prompts=10)
    records = summary["records"]
    rewards = [r["reward_mean_generated"] for r in records]
    assert sum(rewards[:5]) / 5 < 0.25, rewards[:5]  # chance: 1/30 a sample
    assert summary["reached_target"], rewards[-20:]
    assert summary["eval_after"]["accuracy"] >= 0.9, summary["eval_after"]
    assert summary["final_status"]["ledger"]["problems"] == []
    if algorithm in VALUE_BASED:
        explained = [r["value_explained_variance_window"] for r in records if "value_explained_variance_window" in r]
        assert max(explained) > 0.35, explained[-10:]
        # A critic four value steps a policy step behind learned on samples ~60 versions old.
        lags = [r["weight_version"] - r["value_batch_policy_version"] for r in records if "value_batch_policy_version" in r]
        assert max(lags) <= 30, lags
