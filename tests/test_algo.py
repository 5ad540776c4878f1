"""Hand-computed values from docs/algorithms.md §12, loop references and gradient directions."""

import numpy as np
import pytest
import torch

from asyncrl.algo.advantages import (discounted_returns, gae, grpo_advantages, leave_one_out, masked_whiten,
                                     reinforce_plus_plus)
from asyncrl.algo.losses import agg_loss, kl_penalty, ppo_policy_loss
from asyncrl.algo.shaping import group_has_signal, overlong_penalty

T = torch.tensor


# --- GRPO -----------------------------------------------------------------------------------------


def test_grpo_hand_values():
    # [1,0,0,1]: mean .5, unbiased std sqrt(1/3)=.57735 -> ±.5/.57735 = ±.8660
    adv = grpo_advantages(T([1.0, 0, 0, 1]), T([0, 0, 0, 0]))
    np.testing.assert_allclose(adv.numpy(), [0.8660, -0.8660, -0.8660, 0.8660], atol=1e-4)
    # [1,-1,-1,-1]: mean -.5, std 1 -> [1.5,-.5,-.5,-.5]
    adv = grpo_advantages(T([1.0, -1, -1, -1]), T([3, 3, 3, 3]))
    np.testing.assert_allclose(adv.numpy(), [1.5, -0.5, -0.5, -0.5], atol=1e-5)


def test_grpo_groups_are_independent_and_edge_cases():
    scores = T([1.0, 0, 0, 1, 5.0, 5.0, 2.0])
    groups = T([7, 7, 7, 7, 2, 2, 9])
    adv = grpo_advantages(scores, groups)
    np.testing.assert_allclose(adv[:4].numpy(), [0.8660, -0.8660, -0.8660, 0.8660], atol=1e-4)
    assert torch.equal(adv[4:6], T([0.0, 0.0]))  # all equal: exactly zero
    assert float(adv[6]) == pytest.approx(2.0 / (1 + 1e-6))  # group of one: mean 0, std 1
    dr = grpo_advantages(T([1.0, 0, 0, 1]), T([0, 0, 0, 0]), scale_by_std=False)
    np.testing.assert_allclose(dr.numpy(), [0.5, -0.5, -0.5, 0.5])


def test_grpo_matches_loop_reference():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=40)
    groups = rng.integers(0, 7, size=40)
    adv = grpo_advantages(T(scores), T(groups)).numpy()
    for g in np.unique(groups):
        s = scores[groups == g]
        expected = (s - s.mean()) / (s.std(ddof=1) + 1e-6) if len(s) > 1 else s / (1 + 1e-6)
        np.testing.assert_allclose(adv[groups == g], expected, rtol=1e-5, atol=1e-6)


# --- RLOO -----------------------------------------------------------------------------------------


def test_rloo_hand_values():
    # [1,0,0,1]: each against the mean of the other three: 1 − 1/3 = 2/3, 0 − 2/3 = −2/3 (verl's
    # form: R·4/3 − mean·4/3 with mean .5 gives the same).
    np.testing.assert_allclose(leave_one_out(T([1.0, 0, 0, 1])).numpy(), [2 / 3, -2 / 3, -2 / 3, 2 / 3], atol=1e-6)
    # [2,0,1]: 2 − .5 = 1.5, 0 − 1.5 = −1.5, 1 − 1 = 0.
    np.testing.assert_allclose(leave_one_out(T([2.0, 0, 1])).numpy(), [1.5, -1.5, 0.0], atol=1e-6)
    assert leave_one_out(T([3.0])).tolist() == [3.0]  # a group of one keeps its score (verl)
    assert leave_one_out(T([0.5, 0.5])).tolist() == [0.0, 0.0]  # no signal: exactly zero


@pytest.mark.parametrize("g", [2, 3, 8, 33])
def test_rloo_matches_the_leave_one_out_loop(g):
    scores = np.random.default_rng(g).normal(size=g)
    expected = [scores[i] - np.mean(np.delete(scores, i)) for i in range(g)]
    np.testing.assert_allclose(leave_one_out(T(scores)).numpy(), expected, rtol=1e-5, atol=1e-6)


# --- REINFORCE++ ------------------------------------------------------------------------------------

REWARDS = T([[0.0, 0.0, 1.0], [0.5, -1.0, 0.0]])
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_reinforce_plus_plus_hand_values():
    # γ = 1. Returns (restarting after each row's end): row 0 [1, 1, 1]; row 1: t1 −1, t0 .5 − 1 = −.5.
    # Whitened over the 5 valid tokens [1, 1, 1, −.5, −1]: mean .3, unbiased var (3·.49 + .64 + 1.69)/4
    # = .95, std .974679: .7/.974679 = .718185, −.8/.974679 = −.820783, −1.3/.974679 = −1.333772.
    adv = reinforce_plus_plus(REWARDS, MASK, gamma=1.0)
    np.testing.assert_allclose(adv.numpy(), [[0.718185, 0.718185, 0.718185], [-0.820783, -1.333772, 0.0]], atol=1e-5)
    # γ = .5: returns row 0 [.25, .5, 1], row 1 [.5 − .5 = 0, −1]; mean .15, var 2.2/4 = .55, std .741620.
    np.testing.assert_allclose(discounted_returns(REWARDS, MASK, 0.5).numpy(), [[0.25, 0.5, 1.0], [0.0, -1.0, 0.0]])
    adv = reinforce_plus_plus(REWARDS, MASK, gamma=0.5)
    np.testing.assert_allclose(adv.numpy(), [[0.134840, 0.471940, 1.146140], [-0.202260, -1.550660, 0.0]], atol=1e-5)
    # Whitening over the trained tokens only (a stale token masked): its advantage is 0, the others'
    # moments are theirs: [1, 1, −.5, −1] -> mean .125, var (2·.765625 + .390625 + 1.265625)/3 = 1.0625.
    trained = T([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    adv = reinforce_plus_plus(REWARDS, MASK, gamma=1.0, trained=trained)
    std = 1.0625 ** 0.5
    np.testing.assert_allclose(adv.numpy(), [[0.875 / std, 0.0, 0.875 / std], [-0.625 / std, -1.125 / std, 0.0]],
                               atol=1e-5)


@pytest.mark.parametrize("length", [1, 3, 16])
def test_reinforce_plus_plus_matches_a_loop(length):
    rng = np.random.default_rng(length)
    rewards = rng.normal(size=(4, length))
    lengths = rng.integers(1, length + 1, size=4)
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float64)
    returns = np.zeros_like(rewards)
    for b in range(4):
        running = 0.0
        for t in reversed(range(lengths[b])):
            running = rewards[b, t] + 0.9 * running
            returns[b, t] = running
    valid = returns[mask > 0]
    expected = (returns - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8) * mask if valid.size > 1 else returns * 0
    got = reinforce_plus_plus(T(rewards), T(mask), gamma=0.9).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_reinforce_plus_plus_credits_the_better_response_everywhere():
    """Gradient direction: the response with the higher outcome gets positive advantages at every
    token, the other negative (the batch is its only baseline)."""
    adv = reinforce_plus_plus(T([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2))
    assert bool((adv[0] > 0).all()) and bool((adv[1] < 0).all())


# --- GAE ------------------------------------------------------------------------------------------

V = T([[0.2, 0.4, 0.5, 0.7]])
R = T([[0.0, 0.0, 0.0, 1.0]])
M = torch.ones(1, 4)


def test_gae_complete_response_hand_values():
    adv, ret = gae(R, V, M, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv.numpy(), [[0.8, 0.6, 0.5, 0.3]], atol=1e-6)
    np.testing.assert_allclose(ret.numpy(), [[1, 1, 1, 1]], atol=1e-6)
    adv, ret = gae(R, V, M, gamma=1.0, lam=0.95)
    np.testing.assert_allclose(adv.numpy(), [[0.7327, 0.5608, 0.4850, 0.3000]], atol=1e-4)
    np.testing.assert_allclose(ret.numpy(), [[0.9327, 0.9608, 0.9850, 1.0]], atol=1e-4)
    adv, _ = gae(R, V, M, gamma=1.0, lam=0.0)
    np.testing.assert_allclose(adv.numpy(), [[0.2, 0.1, 0.2, 0.3]], atol=1e-6)


def _gae_loop(r, v, m, gamma, lam):
    """Naive reference: GAE over the valid positions only, padding removed."""
    idx = [t for t in range(len(r)) if m[t] > 0]
    adv = np.zeros(len(r))
    last, next_v = 0.0, 0.0
    for t in reversed(idx):
        delta = r[t] + gamma * next_v - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
        next_v = v[t]
    return adv


@pytest.mark.parametrize("length", [1, 3, 17])
def test_gae_matches_loop_with_masked_holes(length):
    rng = np.random.default_rng(length)
    r, v = rng.normal(size=(3, length)), rng.normal(size=(3, length))
    m = (rng.random((3, length)) > 0.3).astype(float)
    m[:, 0] = 1
    lam = T([0.9, 0.95, 1.0], dtype=torch.float64)
    adv, _ = gae(T(r), T(v), T(m), gamma=0.99, lam=lam)
    for row in range(3):
        np.testing.assert_allclose(adv[row].numpy(), _gae_loop(r[row], v[row], m[row], 0.99, float(lam[row])) * m[row], atol=1e-9)


def test_gae_carry_forward_invariance():
    # Inserting masked positions inside the response leaves valid-position values unchanged.
    r = T([[0.0, 0.0, 0.0, 0.0, 1.0]])
    v = T([[0.2, 0.4, 99.0, 0.5, 0.7]])
    m = T([[1.0, 1.0, 0.0, 1.0, 1.0]])
    adv, ret = gae(r, v, m, gamma=1.0, lam=0.95)
    np.testing.assert_allclose(adv[0, [0, 1, 3, 4]].numpy(), [0.7327, 0.5608, 0.4850, 0.3000], atol=1e-4)
    np.testing.assert_allclose(ret[0, [0, 1, 3, 4]].numpy(), [0.9327, 0.9608, 0.9850, 1.0], atol=1e-4)


def test_masked_whiten():
    x = T([[1.0, 2.0, 3.0, 100.0]])
    m = T([[1.0, 1.0, 1.0, 0.0]])
    w = masked_whiten(x, m)
    np.testing.assert_allclose(w[0, :3].numpy(), [-1.0, 0.0, 1.0], atol=1e-6)  # unbiased var = 1
    assert float(w[0, 3]) == 0.0
    # Against given moments (the assembler's running ones): (x - 1) / sqrt(4) = [0, .5, 1].
    w = masked_whiten(x, m, mean=1.0, var=4.0)
    np.testing.assert_allclose(w[0, :3].numpy(), [0.0, 0.5, 1.0], atol=1e-6)
    assert float(w[0, 3]) == 0.0


def test_whiten_rows_is_masked_whiten_over_the_trained_tokens():
    """The assembler's `whiten_rows` (production) whitens exactly as `masked_whiten` (tested above):
    rows concatenated, loss-masked tokens excluded and left at 0."""
    from asyncrl.assembly.rows import whiten_rows
    from asyncrl.messages.structs import FinishReason, Segment, TrainingRow, float32_array, int32_array

    def row(advantages, loss_mask):
        n = len(advantages)
        seg = Segment(prompt_id="p", sample_idx=0, window=0, group_id="p", group_size=1, prompt_token_ids=int32_array([1]),
                      prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                      new_token_ids=int32_array([5] * n), new_logprobs=float32_array([-1.0] * n),
                      new_versions=int32_array([0] * n), finished=True, finish_reason=FinishReason.EOS,
                      data_source="tiny", ground_truth="1")
        return TrainingRow(segment=seg, score=0.0, advantages=float32_array(advantages),
                           loss_mask=np.asarray(loss_mask, dtype=np.uint8))

    rows = whiten_rows([row([1.0, 2.0], [1, 1]), row([3.0, 100.0], [1, 0])])
    np.testing.assert_allclose(np.concatenate([r.advantages for r in rows]), [-1.0, 0.0, 1.0, 0.0], atol=1e-6)
    rows = whiten_rows([row([1.0, 2.0], [1, 1]), row([3.0, 100.0], [1, 0])], mean=1.0, std=2.0)
    np.testing.assert_allclose(np.concatenate([r.advantages for r in rows]), [0.0, 0.5, 1.0, 0.0], atol=1e-6)


# --- policy loss ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "adv,ratio,expected",
    [(1, 1.35, -1.28), (1, 1.25, -1.25), (1, 0.5, -0.5), (-1, 0.7, 0.8), (-1, 1.5, 1.5), (-1, 5.0, 3.0)],
)
def test_clip_higher_and_dual_clip_hand_values(adv, ratio, expected):
    logp = torch.log(T([[ratio]]))
    loss, _ = ppo_policy_loss(logp, torch.zeros(1, 1), T([[float(adv)]]), torch.ones(1, 1), 0.2, 0.28, dual_clip=3.0)
    assert float(loss) == pytest.approx(expected, abs=1e-6)


def test_policy_loss_matches_loop_and_reports_clip_fractions():
    rng = np.random.default_rng(1)
    logp, old = rng.normal(size=(4, 9)) * 0.3, rng.normal(size=(4, 9)) * 0.3
    adv, m = rng.normal(size=(4, 9)), (rng.random((4, 9)) > 0.2).astype(float)
    loss, metrics = ppo_policy_loss(T(logp), T(old), T(adv), T(m), 0.2, 0.28, dual_clip=3.0)
    total, count, clipped = 0.0, 0, 0
    for b in range(4):
        for t in range(9):
            if not m[b, t]:
                continue
            rho = np.exp(logp[b, t] - old[b, t])
            a = adv[b, t]
            pg = max(-a * rho, -a * np.clip(rho, 0.8, 1.28))
            clipped += -a * np.clip(rho, 0.8, 1.28) > -a * rho
            if a < 0:
                pg = min(pg, -a * 3.0)
            total += pg
            count += 1
    assert float(loss) == pytest.approx(total / count, rel=1e-9)
    assert metrics["clip_fraction"] == pytest.approx(clipped / count)


def test_policy_gradient_direction():
    # Positive advantage: descending the loss raises the token's log-prob; negative lowers it.
    for sign in (1.0, -1.0):
        logp = torch.zeros(1, 3, requires_grad=True)
        loss, _ = ppo_policy_loss(logp, torch.zeros(1, 3), torch.full((1, 3), sign), torch.ones(1, 3), 0.2, 0.28)
        loss.backward()
        assert bool((logp.grad * sign < 0).all())
    # Masked tokens get exactly zero gradient.
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = ppo_policy_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), T([[1.0, 0.0, 1.0]]), 0.2, 0.28)
    loss.backward()
    assert float(logp.grad[0, 1]) == 0.0


def test_aggregation_modes_hand_values():
    # Two sequences: length 1 with loss a=1, length 3 with losses b=3.
    loss = T([[1.0, 0.0, 0.0], [3.0, 3.0, 3.0]])
    mask = T([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert float(agg_loss(loss, mask, "token-mean")) == pytest.approx(2.5)
    assert float(agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx(2.0)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(5.0)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(10.0 / 3)
    with pytest.raises(ValueError, match="aggregation"):
        agg_loss(loss, mask, "mean")


def test_kl_estimators():
    logp, ref = T([-1.0, -2.0]), T([-1.5, -2.0])
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1").numpy(), [0.5, 0.0])
    # k3: e^{-0.5} + 0.5 - 1 = 0.106531
    np.testing.assert_allclose(kl_penalty(logp, ref, "low_var_kl").numpy(), [0.106531, 0.0], atol=1e-6)
    assert bool((kl_penalty(torch.randn(100), torch.randn(100), "low_var_kl") >= 0).all())


# --- DAPO shaping ---------------------------------------------------------------------------------


def test_overlong_penalty_hand_values():
    lengths = T([16000, 16384, 17408, 18432, 20480, 20481])
    np.testing.assert_allclose(
        overlong_penalty(lengths, 20480, 4096).numpy(), [0, 0, -0.25, -0.5, -1, -1], atol=1e-6
    )
    assert bool((overlong_penalty(lengths, 20480, 0) == 0).all())


def test_dynamic_sampling_filter():
    assert not group_has_signal(T([1.0, 1, 1, 1]))
    assert not group_has_signal(T([0.0, 0, 0, 0]))
    assert group_has_signal(T([1.0, 0, 0, 0]))
    assert group_has_signal(T([1.0]))


def test_router_balance_loss_by_hand_and_as_transformers_computes_it():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from asyncrl.algo.losses import router_balance_loss

    ln3 = float(np.log(3.0))
    layer = torch.tensor([[ln3, 0.0], [ln3, 0.0], [0.0, ln3]])  # probs .75/.25, .75/.25, .25/.75
    # Top-1 over the first two tokens: every token to expert 0 (f = [1, 0]), P = [.75, .25]: 2 * .75.
    valid = torch.tensor([True, True, False])
    assert router_balance_loss([layer], 1, valid).item() == pytest.approx(1.5)
    # All three: f = [2/3, 1/3], P = [7/12, 5/12]: 2 * (14/36 + 5/36) = 19/18.
    assert router_balance_loss([layer], 1).item() == pytest.approx(19 / 18)
    # Uniform routing gives top_k; layers are pooled as transformers pools them.
    flat = torch.zeros(4, 8)
    assert router_balance_loss([flat[:, :8]], 2).item() == pytest.approx(2.0)
    torch.manual_seed(0)
    layers = [torch.randn(5, 8, requires_grad=True) for _ in range(3)]
    ours = router_balance_loss(layers, 2)
    theirs = load_balancing_loss_func(tuple(layers), 8, 2)
    assert ours.item() == pytest.approx(float(theirs), rel=1e-6)
    ours.backward()
    assert all(layer.grad is not None and layer.grad.abs().sum() > 0 for layer in layers)
