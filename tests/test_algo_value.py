"""EGAE, decoupled and length-adaptive λ, value loss, positive-example NLL (docs/algorithms.md §3, §4, §6, §12)."""

import numpy as np
import pytest
import torch

from asyncrl.algo.advantages import critic_returns, egae, gae, length_adaptive_lambda, tppo_lambda_lengths
from asyncrl.algo.losses import positive_example_nll, value_loss

T = torch.tensor
V = T([[0.2, 0.4, 0.5, 0.7]], dtype=torch.float64)
ZERO_R = torch.zeros(1, 4, dtype=torch.float64)
ONES = torch.ones(1, 4, dtype=torch.float64)


def test_egae_truncated_hand_values():
    # Unfinished row, r = 0, γ = 1: bootstrap V_last, so λ=1 gives Â_t = V_last − V_t.
    adv, ret = egae(ZERO_R, V, ONES, T([False]), gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv.numpy(), [[0.5, 0.3, 0.2, 0.0]], atol=1e-12)
    adv, _ = egae(ZERO_R, V, ONES, T([False]), gamma=1.0, lam=0.95)
    # δ = [.2, .1, .2, 0]; Â_2 = .2; Â_1 = .1 + .95·.2 = .29; Â_0 = .2 + .95·.29 = .4755
    np.testing.assert_allclose(adv.numpy(), [[0.4755, 0.29, 0.2, 0.0]], atol=1e-12)
    assert bool((ret == 0).all())  # unfinished rows have no critic target


def test_egae_finished_row_is_plain_gae():
    r = T([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    adv, ret = egae(r, V, ONES, T([True]), gamma=1.0, lam=0.95)
    np.testing.assert_allclose(adv.numpy(), [[0.7327, 0.5608, 0.4850, 0.3000]], atol=1e-4)
    np.testing.assert_allclose(ret.numpy(), [[0.9327, 0.9608, 0.9850, 1.0]], atol=1e-4)


def test_egae_last_td_with_discount():
    adv, _ = egae(ZERO_R, V, ONES, T([False]), gamma=0.99, lam=0.0)
    assert float(adv[0, 3]) == pytest.approx(-0.01 * 0.7)  # δ_{l−1} = (γ−1)·V_{l−1}


def test_window_edge_mask_only_on_unfinished_rows():
    values = torch.rand(2, 12, dtype=torch.float64) + 0.1
    mask = torch.ones(2, 12, dtype=torch.float64)
    mask[0, 10:] = 0  # row 0 has 10 valid tokens
    adv, _ = egae(torch.zeros(2, 12, dtype=torch.float64), values, mask, T([False, True]), 1.0, 0.95, edge_mask_tokens=8)
    assert bool((adv[0, 2:10] == 0).all()) and bool((adv[0, :2] != 0).all())
    plain, _ = egae(torch.zeros(2, 12, dtype=torch.float64), values, mask, T([False, True]), 1.0, 0.95)
    assert torch.equal(adv[1], plain[1])  # finished rows unaffected


def test_decoupled_lambda():
    """VC-PPO: the critic's targets (`critic_returns`, what `value_step` trains on) use the critic λ,
    the policy's advantages (`egae` on a finished row, what `value_rows` computes) the policy λ."""
    # Critic λ=1, γ=1, sparse R=1, no KL: every return is R, for any V.
    r = T([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.rand(1, 4, dtype=torch.float64)
    ret = critic_returns(r, values, ONES, 1.0, lam_critic=1.0)
    adv, _ = egae(r, values, ONES, T([True]), 1.0, 0.95)
    np.testing.assert_allclose(ret.numpy(), np.ones((1, 4)), atol=1e-12)
    assert not torch.allclose(ret, adv + values)  # the two λ differ, so returns ≠ Â_actor + V
    # With V ≡ 0 and λ_a = .95: Â_t = .95^(L−1−t)·R; the critic λ = .95 would give the same targets.
    adv, _ = egae(r, torch.zeros(1, 4, dtype=torch.float64), ONES, T([True]), 1.0, 0.95)
    np.testing.assert_allclose(adv.numpy(), [[0.95**3, 0.95**2, 0.95, 1.0]], atol=1e-12)
    np.testing.assert_allclose(critic_returns(r, torch.zeros(1, 4, dtype=torch.float64), ONES, 1.0, 0.95).numpy(),
                               adv.numpy(), atol=1e-12)


def test_length_adaptive_lambda_table_and_both_clamps():
    lengths = T([10, 20, 40, 100, 200, 1000, 2000, 8192, 20480])
    raw = 1 - 1 / (0.05 * lengths.double())
    np.testing.assert_allclose(raw.numpy(), [-1.0, 0.0, 0.5, 0.8, 0.9, 0.98, 0.99, 0.997559, 0.999023], atol=1e-6)
    nemo = length_adaptive_lambda(lengths, 0.05)
    np.testing.assert_allclose(nemo[:2].numpy(), [0.0, 0.0])  # 0 for l <= 20
    np.testing.assert_allclose(nemo[2:].numpy(), raw[2:].numpy(), atol=1e-12)
    floored = length_adaptive_lambda(T([100, 400, 1000]), 0.05, floor=0.95)
    np.testing.assert_allclose(floored.numpy(), [0.95, 0.95, 0.98], atol=1e-12)  # 0.95 for l <= 400
    # T-PPO: unfinished, 8192 generated, W = 8192 -> l = 12288, λ = 1 − 1/614.4 = 0.998372
    l = tppo_lambda_lengths(T([8192, 100]), T([False, True]), 8192)
    lam = length_adaptive_lambda(l, 0.05, floor=0.95)
    np.testing.assert_allclose(lam.numpy(), [0.998372, 0.95], atol=1e-6)


def test_per_row_lambda_matches_scalar_runs():
    rng = np.random.default_rng(0)
    r, v = T(rng.normal(size=(3, 7))), T(rng.normal(size=(3, 7)))
    m = torch.ones(3, 7, dtype=torch.float64)
    lam = T([0.5, 0.9, 1.0], dtype=torch.float64)
    adv, _ = gae(r, v, m, 1.0, lam)
    for i in range(3):
        row, _ = gae(r[i:i + 1], v[i:i + 1], m[i:i + 1], 1.0, float(lam[i]))
        torch.testing.assert_close(adv[i:i + 1], row)


def test_value_loss_clipping_and_zero_gradient_on_masked_rows():
    old = T([[0.0]])
    # V = V_old + 1, ε = 0.5: the clipped branch uses V_old + 0.5. G = 2: max((1−2)², (0.5−2)²) = 2.25.
    loss, metrics = value_loss(old + 1.0, old, T([[2.0]]), T([[1.0]]), 0.5, 0.5)
    assert float(loss) == pytest.approx(0.5 * 2.25)
    assert metrics["value_clip_fraction"] == 1.0
    values = torch.rand(2, 3, requires_grad=True)
    mask = T([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # row 1: an unfinished row, no target
    loss, _ = value_loss(values, values.detach(), torch.ones(2, 3), mask, 0.5, 0.6)
    loss.backward()
    assert bool((values.grad[1] == 0).all()) and bool((values.grad[0] != 0).all())


def test_positive_example_nll():
    logp = T([[-1.0, -2.0], [-3.0, -4.0]])
    mask = torch.ones(2, 2)
    assert float(positive_example_nll(logp, mask, T([False, False]))) == 0.0
    assert float(positive_example_nll(logp, mask, T([True, False]))) == pytest.approx(1.5)
    assert float(positive_example_nll(logp, mask, T([True, True]))) == pytest.approx(2.5)
    # Micro-batches: each part divides by the whole batch's count (4 tokens), so the parts add up.
    parts = [positive_example_nll(logp[i : i + 1], mask[i : i + 1], T([True]), normalizer=4.0) for i in range(2)]
    assert float(sum(parts)) == pytest.approx(2.5)
