"""DQO (docs/algorithms.md §11): the section's properties as tests, a hand-worked case, and one update of
a real tiny policy and value model moving the way the soft Bellman residual says."""

import numpy as np
import pytest
import torch

from asyncrl.algo.dqo import dqo_losses, importance_weights, soft_targets
from asyncrl.config import ModelConfig
from asyncrl.config import (Compute, CriticConfig, DQOConfig, Optimizer, PolicyCompute, PolicyConfig,
                            SamplingConfig)
from asyncrl.learning.dqo import dqo_step
from asyncrl.learning.scoring import response_logprobs
from asyncrl.messages.structs import FinishReason, ScoredTrajectory, Segment, float32_array, int32_array
from asyncrl.models.loading import build_tiny_model, value_model_from_policy


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_with_lambda_one_and_no_kl_the_target_is_the_sum_of_future_rewards():
    rewards, mask = t([0.5, 0.0, 1.0], [0.0, 2.0, 0.0]), t([1, 1, 1], [1, 1, 0])
    values = t([0.3, -0.2, 0.9], [0.1, 0.4, 0.0])  # any values: λ = 1 does not bootstrap
    value_targets, q_targets = soft_targets(rewards, torch.zeros_like(rewards), values, mask, 0.1, 1.0, 1.0)
    np.testing.assert_allclose(value_targets.numpy(), [[1.5, 1.0, 1.0], [2.0, 2.0, 0.0]])
    np.testing.assert_allclose(q_targets.numpy(), value_targets.numpy())  # no KL: Q̂ = G̃


@pytest.mark.parametrize("lam", [1.0, 0.5, 0.0])
def test_a_policy_equal_to_the_reference_with_exact_values_has_zero_loss(lam):
    # r_h + V(s_{h+1}) = V(s_h) at every h: V = [1, 1, 1] with the reward on the last token.
    rewards, mask, values = t([0.0, 0.0, 1.0]), t([1, 1, 1]), t([1.0, 1.0, 1.0])
    logp = t([-1.2, -0.3, -2.0])
    policy_loss, value_loss, _ = dqo_losses(logp, logp, logp, values, rewards, mask, beta=0.5, lam=lam)
    assert float(policy_loss) == pytest.approx(0.0, abs=1e-12) and float(value_loss) == pytest.approx(0.0, abs=1e-12)


def test_importance_weights_are_one_on_policy_and_clipped_off_it():
    logp = torch.randn(4, 7, dtype=torch.float64)
    assert torch.equal(importance_weights(logp, logp, 0.2), torch.ones_like(logp))
    far = importance_weights(logp, logp + 3.0 * torch.randn_like(logp), 0.2)
    assert float(far.min()) >= 0.8 - 1e-12 and float(far.max()) <= 1.2 + 1e-12
    assert bool((far == 0.8).any()) and bool((far == 1.2).any())
    # No gradient flows through the weight.
    live = logp.clone().requires_grad_(True)
    assert not importance_weights(live, logp, 0.2).requires_grad


def test_hand_worked_case():
    # β = 0.5, γ = 1, λ = 0.5; rewards [0, 1]; log π_θ/π_ref = [0.2, −0.1]; V = [0.3, 0.6].
    #   r̃ = r − β·logratio = [−0.1, 1.05]
    #   G̃_1 = 1.05;  G̃_0 = −0.1 + (1 − λ)·0.6 + λ·1.05 = 0.725
    #   Q̂ = G̃ + β·logratio = [0.825, 1.0];  Q = β·logratio + V = [0.4, 0.55]
    #   policy loss = mean((Q − Q̂)²) = mean(0.180625, 0.2025) = 0.1915625 (the value loss too:
    #   numerically Q − Q̂ = V − G̃; their gradients differ)
    reference = t([-1.0, -2.0])
    policy = (reference + t([0.2, -0.1])).requires_grad_(True)
    values = t([0.3, 0.6]).requires_grad_(True)
    rewards, mask = t([0.0, 1.0]), t([1, 1])
    value_targets, q_targets = soft_targets(rewards, policy - reference, values, mask, 0.5, 1.0, 0.5)
    np.testing.assert_allclose(value_targets.numpy(), [[0.725, 1.05]])
    np.testing.assert_allclose(q_targets.numpy(), [[0.825, 1.0]])
    policy_loss, value_loss, metrics = dqo_losses(policy, reference, policy.detach(), values, rewards, mask,
                                                  beta=0.5, lam=0.5)
    assert policy_loss.item() == pytest.approx(0.1915625) and value_loss.item() == pytest.approx(0.1915625)
    (policy_loss + value_loss).backward()
    # d/dlogπ_t = 2·(Q_t − Q̂_t)·β / 2: [−0.2125, −0.225]. Both returns exceed V, so descent raises
    # the log-probs of both actions; the value gradient pulls V up towards G̃.
    np.testing.assert_allclose(policy.grad.numpy(), [[-0.2125, -0.225]])
    np.testing.assert_allclose(values.grad.numpy(), [[-0.425, -0.45]])
    assert metrics["dqo_importance_weight_mean"] == pytest.approx(1.0)


def _trajectory(prompt, response, score, logprobs):
    n = len(response)
    segment = Segment(prompt_id="p", sample_idx=0, window=0, group_id="p", prompt_token_ids=int32_array(prompt),
                      prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                      new_token_ids=int32_array(response), new_logprobs=float32_array(logprobs),
                      new_versions=int32_array([0] * n), finished=True, finish_reason=FinishReason.EOS)
    return ScoredTrajectory(segment=segment, score=score)


def test_one_update_raises_the_rewarded_response_and_lowers_the_penalised_one():
    policy = build_tiny_model(ModelConfig(source="tiny", seed=1), 30)
    reference = build_tiny_model(ModelConfig(source="tiny", seed=1), 30)
    value_model = value_model_from_policy(build_tiny_model(ModelConfig(source="tiny", seed=1), 30))
    prompt, good, bad = [5, 6], [10, 1], [11, 1]
    rows = [(int32_array(prompt), int32_array(good)), (int32_array(prompt), int32_array(bad))]
    ref = response_logprobs(reference, rows, 1.0)
    # Rewards +1 and −1 (DAPO's verifier) against a value model that starts at 0 (zero head).
    trajectories = [_trajectory(prompt, good, 1.0, ref[0]), _trajectory(prompt, bad, -1.0, ref[1])]
    dqo = DQOConfig(beta=0.1, gamma=1.0, lam=1.0, importance_clip=0.2)

    def sections(micro_batch_tokens):
        return (PolicyConfig(optimizer=Optimizer(grad_clip=1e9), compute=PolicyCompute(micro_batch_tokens=micro_batch_tokens)),
                CriticConfig(optimizer=Optimizer(grad_clip=1e9), compute=Compute()), SamplingConfig(temperature=1.0))
    policy_opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    value_opt = torch.optim.SGD(value_model.parameters(), lr=0.5)
    metrics = dqo_step(policy, value_model, policy_opt, value_opt, trajectories, ref, dqo, sections(4096))
    after = response_logprobs(policy, rows, 1.0)
    assert after[0].sum() > ref[0].sum() and after[1].sum() < ref[1].sum()
    assert metrics["grad_norm"] > 0 and metrics["value_grad_norm"] > 0
    # Micro-batching does not change the update (token means add up exactly).
    policy2 = build_tiny_model(ModelConfig(source="tiny", seed=1), 30)
    value2 = value_model_from_policy(build_tiny_model(ModelConfig(source="tiny", seed=1), 30))
    metrics2 = dqo_step(policy2, value2, torch.optim.SGD(policy2.parameters(), lr=0.5),
                        torch.optim.SGD(value2.parameters(), lr=0.5), trajectories, ref, dqo, sections(4))
    assert metrics2["dqo_policy_loss"] == pytest.approx(metrics["dqo_policy_loss"], rel=1e-5)
    np.testing.assert_allclose(response_logprobs(policy2, rows, 1.0)[0], after[0], atol=1e-5)
