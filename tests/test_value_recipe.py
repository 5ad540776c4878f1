"""The value-based recipes on the same surface as DAPO's (issue 30): settings an advantage cannot
honour are refused at start-up, a fresh critic starts at the mean return, its warm-up ends when it
stops learning, and dynamic sampling filters whole-response groups for PPO-family estimators."""

import asyncio

import numpy as np
import pytest

from actors.assembler import Assembler
from asyncrl.algo.warmup import mean_return_bias, warmup_finished
from asyncrl.assembly.values import ValueEdges, ValueStrategy
from asyncrl.config import ConfigError, DynamicSampling, GAEAdvantage, ModelConfig, OverlongShaping, compose
from asyncrl.learning.value import center_value_head, predict_values
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.messages.structs import FinishReason, Reward, ScoredTrajectory, Segment, float32_array, int32_array
from asyncrl.models.loading import build_tiny_model, value_model_from_policy


def test_settings_an_advantage_cannot_honour_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="cannot filter T-PPO's windows"):
        compose(["algorithm=tppo", "algorithm.dynamic_sampling.enabled=true"])
    with pytest.raises(ConfigError, match="max_refill_rounds"):
        compose(["algorithm=vapo", "algorithm.dynamic_sampling.max_refill_rounds=4"])
    with pytest.raises(ConfigError, match="algorithm.advantage is type grpo, which has no field 'whiten'"):
        compose(["algorithm=dapo", "algorithm.advantage.whiten=true"])
    with pytest.raises(ConfigError, match="critic.init_path"):
        compose(["algorithm=grpo", "critic.init_path=/tmp/critic"])
    # Honoured now: dynamic sampling on whole responses, and DAPO's length shaping, for any algorithm.
    config = compose(["algorithm=vapo", "algorithm.dynamic_sampling.enabled=true", "algorithm.overlong.buffer_tokens=16"])
    assert config.algorithm.dynamic_sampling.enabled and config.algorithm.overlong.buffer_tokens == 16


def test_the_warm_up_ends_when_the_critic_stops_learning_and_is_bounded():
    # min 2 steps, max 10, patience 2, gain 0.01 (hand-worked: the best before the last two steps
    # against the best of the last two).
    assert not warmup_finished([0.1], 2, 10, 2, 0.01)  # too few steps to judge
    assert not warmup_finished([0.1, 0.3, 0.5], 2, 10, 2, 0.01)  # 0.5 > 0.1 + 0.01: still learning
    assert warmup_finished([0.1, 0.3, 0.5, 0.505, 0.502], 2, 10, 2, 0.01)  # 0.505 < 0.5 + 0.01: done
    assert not warmup_finished([0.1, 0.3, 0.5, 0.505, 0.52], 2, 10, 2, 0.01)  # 0.52 ≥ 0.51: learning
    assert warmup_finished([0.0] * 10, 2, 10, 2, 0.01)  # the bound, learning or not
    assert not warmup_finished([0.0, 0.0, 0.0], 4, 10, 2, 0.01)  # the minimum first


def trajectory(i: int, n: int, score: float) -> ScoredTrajectory:
    seg = Segment(prompt_id=f"p{i}", sample_idx=0, window=0, group_id=f"p{i}", prompt_token_ids=int32_array([3, 4, 5]),
                  prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                  new_token_ids=int32_array([6 + i] * n), new_logprobs=float32_array([-1.0] * n),
                  new_versions=int32_array([0] * n), finished=True, finish_reason=FinishReason.EOS)
    return ScoredTrajectory(segment=seg, score=score)


def test_a_fresh_critic_starts_at_the_mean_return_of_its_first_batch():
    # Returns to go with γ=1 and the score on the last token: every token of a response returns its
    # score. Tokens: 4 at 1.0, 2 at 0.0 -> mean return 4/6.
    assert mean_return_bias(4.0, 1.0, 6) == pytest.approx(0.5)
    model = value_model_from_policy(build_tiny_model(ModelConfig(source="tiny", seed=2), 30))
    batch = [trajectory(0, 4, 1.0), trajectory(1, 2, 0.0)]
    shift = center_value_head(model, batch, gamma=1.0)
    values = predict_values(model, [(t.segment.prompt_token_ids, t.segment.new_token_ids) for t in batch])
    assert shift == pytest.approx(4 / 6, abs=1e-6)  # a zero head: its values were all 0
    assert np.concatenate(values).mean() == pytest.approx(4 / 6, abs=1e-5)


def group_member(pid: str, idx: int, token: int) -> Segment:
    return Segment(prompt_id=pid, sample_idx=idx, window=0, group_id=pid, group_size=2,
                   prompt_token_ids=int32_array([5]), prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                   new_token_ids=int32_array([token]), new_logprobs=float32_array([-1.0]), new_versions=int32_array([0]),
                   finished=True, finish_reason=FinishReason.EOS)


def test_dynamic_sampling_drops_whole_response_groups_without_signal_for_the_ppo_family():
    async def values(rows, images=None):
        return [np.zeros(len(new) + 1, dtype=np.float32) for _, new in rows], 1

    async def ready():
        return True

    async def score(requests):  # token 7 is correct
        return [Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=float(r.response_text == "7"),
                       correct=r.response_text == "7", source="t") for r in requests]

    estimator = ValueStrategy(edges=ValueEdges(values, ready, None), gae=GAEAdvantage(gamma=1.0, lam=1.0),
                              window_tokens=4, rows_per_batch=2, group_filter=DynamicSampling(metric="acc"))

    async def main():
        segments, batches, trajectories, events = (InProcessMailbox(100), InProcessMailbox(100),
                                                   InProcessMailbox(100), [])
        asm = Assembler(segments, batches, score, lambda ids: "".join(map(str, ids)), estimator, OverlongShaping(), 4,
                        trajectories=trajectories, events=lambda evs, outcomes: events.extend(evs))
        await segments.put([group_member("solved", 0, 7), group_member("mixed", 0, 7), group_member("solved", 1, 7),
                            group_member("mixed", 1, 3)])
        for _ in range(3):
            await asm.step(timeout=0.01)
            await asyncio.sleep(0.01)
        out = await batches.get(10, timeout=0.05)
        learned = await trajectories.get(10, timeout=0.05)
        return out, learned, events

    out, learned, events = asyncio.run(main())
    assert [sorted(s.segment.prompt_id for s in b.rows) for b in out] == [["mixed", "mixed"]]
    drops = sorted(sid for ids, state, reason in events if state == "dropped" for sid in ids if reason == "no_signal")
    assert drops == ["solved/0", "solved/1"]
    assert len(learned) == 4  # the critic still learns from the group the policy skipped


def test_the_critic_takes_bf16_autocast_where_it_pays_and_keeps_fp32_master_weights():
    """`critic.compute.precision`: auto resolves as the policy's does (the tiny model stays fp32); bf16
    through the value learner's own builder gives values and a step close to fp32's."""
    import torch

    from actors.value_learner import build_value_learner
    from asyncrl.learning.value import value_step

    def learner(*overrides):
        config = compose(["model=tiny", "task=tiny", "algorithm=ppo", *overrides])
        return build_value_learner(config.model, config.critic, config.algorithm, config.sampling,
                                   config.trainer.seed, InProcessMailbox(2))

    auto, bf16 = learner(), learner("critic.compute.precision=bf16")
    assert auto.critic.compute.precision == "fp32" and auto.stats()["value_precision"] == "fp32"
    assert "under 10M" in auto.stats()["value_precision_choice"]["reason"]
    assert bf16.critic.compute.precision == "bf16" and all(p.dtype == torch.float32 for p in bf16.model.parameters())
    head = torch.randn_like(auto.model.head.weight, generator=torch.Generator().manual_seed(0))
    for m in (auto, bf16):  # the same non-zero head (a fresh one is 0 everywhere)
        with torch.no_grad():
            m.model.head.weight.copy_(head)
    batch = [trajectory(0, 4, 1.0), trajectory(1, 3, 0.0), trajectory(2, 5, 1.0)]
    rows = [(t.segment.prompt_token_ids, t.segment.new_token_ids) for t in batch]
    exact = np.concatenate(predict_values(auto.model, rows))
    approx = np.concatenate(predict_values(bf16.model, rows, precision="bf16"))
    # bf16 ran (the values differ) and stays within 3% of the values' scale (measured: 1.6%).
    assert 0 < np.abs(exact - approx).max() < 0.03 * np.abs(exact).max()
    steps = [value_step(m.model, m.optimizer, batch, m.critic, m.gamma) for m in (auto, bf16)]
    assert steps[1]["value_loss"] == pytest.approx(steps[0]["value_loss"], rel=0.05, abs=1e-3)
    with pytest.raises(ConfigError, match="critic.compute.precision"):
        compose(["critic.compute.precision=fp16"])
