"""Value-based pieces end to end below the actors: rows with (E)GAE, whitening, the value model and
its training step, and the gradient invariants of T-PPO (docs/algorithms.md §6.5)."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from asyncrl.assembly.rows import Outcome, value_rows, whiten_rows
from asyncrl.config import (Compute, CriticConfig, GAEAdvantage, KLPenalty, ModelConfig, Optimizer, PolicyCompute,
                            PolicyConfig, PolicyLoss, SamplingConfig, ValueLoss)
from asyncrl.config.fields import replaced
from asyncrl.learning.policy import Objective, policy_step
from asyncrl.learning.tensors import collate
from asyncrl.learning.value import ExplainedVarianceWindow, dealt_batches, predict_values, value_step
from asyncrl.messages.structs import segment_row
from asyncrl.messages.structs import FinishReason, ScoredTrajectory, Segment, TrainingRow, float32_array, int32_array
from asyncrl.models.loading import build_tiny_model, value_model_from_policy, value_model_from_reward_model

SETTINGS = GAEAdvantage(gamma=1.0, lam=1.0, window_training=True)
W = 4  # engine.window_tokens
OBJECTIVE = Objective(PolicyConfig(loss=PolicyLoss(dual_clip=None), optimizer=Optimizer(grad_clip=1e9),
                                   compute=PolicyCompute(precision="fp32")), SamplingConfig(temperature=1.0), KLPenalty())


def critic(lam=1.0, clip=(None, None), micro_batch_tokens=4096) -> CriticConfig:
    return CriticConfig(loss=ValueLoss(lam=lam, clip_low=clip[0], clip_high=clip[1]), optimizer=Optimizer(grad_clip=1e9),
                        compute=Compute(micro_batch_tokens=micro_batch_tokens, precision="fp32"))


def segment(new, prior=(), finished=True, prompt=(5, 6, 7), window=None, pid="p", idx=0, version=0):
    n = len(new)
    return Segment(prompt_id=pid, sample_idx=idx, window=window if window is not None else (1 if prior else 0), group_id=pid,
                   prompt_token_ids=int32_array(prompt), prior_response_ids=int32_array(list(prior)),
                   prior_versions=int32_array([version] * len(prior)), new_token_ids=int32_array(new),
                   new_logprobs=float32_array([-2.0] * n), new_versions=int32_array([version] * n), finished=finished,
                   finish_reason=FinishReason.EOS if finished else FinishReason.WINDOW)


# V(s_t) for four tokens, then V(s_4) after the last one (what the value learner serves).
V = np.array([0.2, 0.4, 0.5, 0.7, 0.9], dtype=np.float32)


def test_rows_reproduce_section_12_values():
    finished = segment([8, 9, 10, 11])
    cut = segment([8, 9, 10, 11], finished=False, pid="q")
    rows = value_rows([finished, cut], [V, V], [Outcome(1.0, True), None], SETTINGS, W, value_version=3)
    np.testing.assert_allclose(rows[0].advantages, [0.8, 0.6, 0.5, 0.3], atol=1e-6)  # GAE complete, λ=1
    np.testing.assert_allclose(rows[1].advantages, [0.5, 0.3, 0.2, 0.0], atol=1e-6)  # EGAE truncated, λ=1
    assert rows[0].value_version == 3 and rows[0].correct is True and rows[1].correct is None
    lam95 = replaced(SETTINGS, {"lam": 0.95})
    rows = value_rows([finished, cut], [V, V], [Outcome(1.0, True), None], lam95, W)
    np.testing.assert_allclose(rows[0].advantages, [0.7327, 0.5608, 0.4850, 0.3], atol=1e-4)
    np.testing.assert_allclose(rows[1].advantages, [0.4755, 0.29, 0.20, 0.0], atol=1e-4)
    # With the value model's own V(s_l) = 0.9 as the bootstrap (γ=λ=1): Â_t = V(s_l) − V_t.
    nxt = replaced(SETTINGS, {"bootstrap": "next"})
    rows = value_rows([finished, cut], [V, V], [Outcome(1.0, True), None], nxt, W)
    np.testing.assert_allclose(rows[1].advantages, [0.7, 0.5, 0.4, 0.2], atol=1e-6)
    np.testing.assert_allclose(rows[0].advantages, [0.8, 0.6, 0.5, 0.3], atol=1e-6)  # finished: unchanged
    with pytest.raises(ValueError, match="expected n \\+ 1"):
        value_rows([cut], [V[:4]], [None], SETTINGS, W)


def test_edge_mask_leaves_unfinished_window_tails_out_of_the_loss():
    edge = replaced(SETTINGS, {"edge_mask_tokens": 2})
    cut = segment([8, 9, 10, 11], finished=False)
    done = segment([8, 9, 10, 11], prior=[3, 4, 5, 6], pid="q")
    rows = value_rows([cut, done], [V, V], [None, Outcome(1.0)], edge, W)
    assert rows[0].loss_mask.tolist() == [1, 1, 0, 0] and rows[0].advantages[2:].tolist() == [0.0, 0.0]
    assert rows[1].loss_mask.tolist() == [1, 1, 1, 1]
    assert collate(rows).response_mask.sum(-1).tolist() == [2.0, 4.0]


def test_last_window_of_a_response_gets_its_slice_of_dense_rewards_and_lambda_floor():
    # A PRM-style reward per token of the whole 8-token response; the last window holds tokens 4..7.
    dense = float32_array([0, 0, 0, 0, 0.1, 0.2, 0.3, 0.4])
    last = segment([8, 9, 10, 11], prior=[3, 4, 5, 6])
    zero_v = np.zeros(5, dtype=np.float32)
    [row] = value_rows([last], [zero_v], [Outcome(1.0, True, dense)], SETTINGS, W)
    # λ=1, V=0: advantage = reward-to-go = suffix sums of [0.1, 0.2, 0.3, 0.4 + 1].
    np.testing.assert_allclose(row.advantages, [2.0, 1.9, 1.7, 1.4], atol=1e-6)
    # T-PPO λ floor: an unfinished 8192-token window with W=8192 uses λ = 1 − 1/(0.05·12288).
    floor = replaced(SETTINGS, {"lam": 0.95, "length_adaptive_alpha": 0.05, "lambda_floor": True})
    n = 8192
    cut = segment(list(np.full(n, 8)), finished=False)
    values = np.zeros(n + 1, dtype=np.float32)
    values[n - 1], values[n - 2] = 1.0, 0.0
    [row] = value_rows([cut], [values], [None], floor, 8192)
    # Â_{l−2} = δ_{l−2} + γλ·δ_{l−1} = (V_{l−1} − V_{l−2}) + λ·0.
    assert row.advantages[-2] == pytest.approx(1.0)
    assert row.advantages[-3] == pytest.approx(0.998372, abs=1e-6)  # λ·Â_{l−2} with δ_{l−3} = 0


def test_whitening_uses_only_trained_tokens():
    rows = value_rows([segment([8, 9, 10, 11], finished=False), segment([8, 9, 10, 11], pid="q")], [V, V],
                      [None, Outcome(1.0)], replaced(SETTINGS, {"edge_mask_tokens": 1}), W)
    white = whiten_rows(rows, clamp=10.0)
    adv = np.concatenate([r.advantages for r in white])
    mask = np.concatenate([r.loss_mask for r in white]).astype(bool)
    assert abs(adv[mask].mean()) < 1e-6 and adv[mask].std(ddof=1) == pytest.approx(1.0, abs=1e-4)
    assert adv[~mask].tolist() == [0.0]
    assert np.abs(whiten_rows(rows, clamp=0.5)[1].advantages).max() <= 0.5


def tiny_policy(seed=3):
    return build_tiny_model(ModelConfig(source="tiny", seed=seed), 30)


def test_no_gradient_reaches_prompt_or_earlier_windows():
    """§6.5.6: only the current window's tokens are scored; the final hidden state at every context
    position (prompt and earlier windows), which is what the LM head would read there, gets exactly
    zero gradient (the loss reads no prediction made at those positions)."""
    model = tiny_policy()
    captured = {}

    def keep_hidden_grad(module, inputs, output):
        output.register_hook(lambda grad: captured.setdefault("g", grad))

    model.model.norm.register_forward_hook(keep_hidden_grad)
    row = segment([20, 21, 22], prior=[10, 11, 12, 13], prompt=(5, 6, 7))
    sample = TrainingRow(segment=row, score=1.0, advantages=float32_array([5.0, 3.0, 2.0]))  # ratio < 1: unclipped
    policy_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [sample], OBJECTIVE)
    grad_per_position = captured["g"][0].abs().sum(-1)
    context = len(row.prompt_token_ids) + len(row.prior_response_ids)  # 7: logits 0..5 predict context tokens
    assert bool((grad_per_position[: context - 1] == 0).all())
    assert bool((grad_per_position[context - 1 : context - 1 + 3] > 0).all())
    assert bool((grad_per_position[context - 1 + 3 :] == 0).all())


def test_positive_example_nll_only_moves_with_correct_finished_rows():
    def grads(correct, finished, nll_coef):
        model = tiny_policy()
        row = segment([20, 21, 22], finished=finished)
        sample = TrainingRow(segment=row, score=1.0, advantages=float32_array([0.0, 0.0, 0.0]), correct=correct)
        metrics = policy_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [sample],
                              replaced(OBJECTIVE, {"nll_coef": nll_coef}))
        return model.lm_head.weight.grad.abs().sum().item(), metrics

    assert grads(True, True, 0.1)[0] > 0  # zero advantages: only the NLL term has a gradient
    assert grads(False, True, 0.1)[0] == 0  # wrong answer: no imitation
    assert grads(True, False, 0.1)[0] == 0  # unfinished window: not a positive example
    assert grads(True, True, 0.0)[0] == 0


def test_value_model_values_align_with_the_state_before_each_token():
    value_model = value_model_from_policy(tiny_policy())
    torch.nn.init.normal_(value_model.head.weight)
    rows = [segment_row(segment([20, 21], prior=[10, 11])), segment_row(segment([22, 23, 24, 25]))]
    values = predict_values(value_model, rows, max_tokens=1)  # one row per forward: batching must not matter
    with_next = predict_values(value_model, rows, with_next=True)
    for (context, new), v, vn in zip(rows, values, with_next):
        full = torch.tensor(np.concatenate([context, new]), dtype=torch.long)[None]
        reference = value_model(full, torch.ones_like(full))[0].detach().numpy()
        c = len(context)
        np.testing.assert_allclose(v, reference[c - 1 : c - 1 + len(new)], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(vn, reference[c - 1 :], rtol=1e-4, atol=1e-5)  # + V after the last token


def test_value_model_starts_at_zero_from_the_policy_and_loads_a_reward_model(tmp_path):
    assert np.all(predict_values(value_model_from_policy(tiny_policy()), [segment_row(segment([20, 21]))])[0] == 0)
    config = LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    reward_model = LlamaForSequenceClassification(config).eval()
    reward_model.save_pretrained(tmp_path)
    value_model = value_model_from_reward_model(str(tmp_path))
    ids = torch.tensor([[5, 6, 7, 20, 21]])
    hidden = reward_model.model(input_ids=ids).last_hidden_state
    expected = reward_model.score(hidden).squeeze(-1)[0]
    got = predict_values(value_model, [segment_row(segment([20, 21]))])[0]
    np.testing.assert_allclose(got, expected[2:4].detach().numpy(), rtol=1e-4, atol=1e-5)


def test_value_step_targets_are_monte_carlo_and_loss_falls():
    """§6.5.5: a finished three-window response with R=+1 has target 1 at every generated position."""
    torch.manual_seed(0)
    value_model = value_model_from_policy(tiny_policy())
    optimizer = torch.optim.Adam(value_model.parameters(), lr=1e-2)
    windows = segment([20, 21, 22, 23, 24, 25], prior=[], window=2)  # merged: all windows as new tokens
    trajectory = ScoredTrajectory(segment=windows, score=1.0, correct=True)
    first = value_step(value_model, optimizer, [trajectory], critic(), 1.0)
    assert first["return_mean"] == pytest.approx(1.0) and first["value_mean"] == pytest.approx(0.0)
    for _ in range(30):
        last = value_step(value_model, optimizer, [trajectory], critic(), 1.0)
    assert last["value_loss"] < 0.1 * first["value_loss"]
    assert np.all(np.abs(predict_values(value_model, [segment_row(windows)])[0] - 1.0) < 0.3)
    with pytest.raises(ValueError, match="not finished"):
        ScoredTrajectory(segment=segment([20], finished=False), score=0.0)


def test_the_explained_variance_window_pools_the_last_batches():
    """Hand-worked: each of the first two batches has constant targets (their own figure is 0: no
    variance), pooled they are explained exactly; the third pushes the first out."""
    window = ExplainedVarianceWindow(batches=2)
    window.add(torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0]))
    window.add(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]))
    assert window.explained_variance() == pytest.approx(1.0)
    window.add(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0]))
    # targets [1, 1, 0, 1] (variance 0.1875), residuals [0, 0, -1, 1] (variance 0.5): 1 - 0.5/0.1875
    assert window.explained_variance() == pytest.approx(1.0 - 0.5 / 0.1875)
    # value_step feeds it: its figure is the pooled one of the batches it has seen.
    torch.manual_seed(0)
    value_model = value_model_from_policy(tiny_policy())
    window = ExplainedVarianceWindow(batches=8)
    trajectories = [ScoredTrajectory(segment=segment([20 + i, 21], prior=[], window=2), score=float(i % 2))
                    for i in range(4)]
    metrics = value_step(value_model, torch.optim.SGD(value_model.parameters(), lr=0.0), trajectories, critic(), 1.0,
                         window=window)
    assert metrics["value_explained_variance_window"] == pytest.approx(metrics["value_explained_variance"])
    assert len(window.parts) == 1 and window.parts[0][0].numel() == 8


def test_batches_are_dealt_across_groups():
    """Two groups of 4 arrive one after the other; dealt into batches of 4, each holds 2 + 2, each
    group's order kept; a third, smaller group fills in where the others end."""
    arrived = [ScoredTrajectory(segment=segment([20 + i], pid=g), score=0.0) for g in "ab" for i in range(4)]

    def names(batches):
        return [[t.segment.group_id + str(int(t.segment.new_token_ids[0]) - 20) for t in b] for b in batches]

    assert names(dealt_batches(arrived, 4)) == [["a0", "b0", "a1", "b1"], ["a2", "b2", "a3", "b3"]]
    three = arrived[:3] + [ScoredTrajectory(segment=segment([20], pid="c"), score=0.0)]
    assert names(dealt_batches(three, 2)) == [["a0", "c0"], ["a1", "a2"]]


def test_the_value_learner_trains_mix_batches_dealt_across_groups_once_all_arrived():
    """`critic.mix_batches=2`, `batch_trajectories=2`: the learner holds what arrives until four
    trajectories are there, then takes two steps, each on one of group a's and one of group b's
    (a group's samples arrive together: without dealing, a batch would be one prompt's)."""
    import asyncio

    from actors.value_learner import ValueLearner
    from asyncrl.messages.mailbox import InProcessMailbox

    mailbox = InProcessMailbox(16)
    learner = ValueLearner(value_model_from_policy(tiny_policy()), mailbox,
                           replaced(critic(), {"batch_trajectories": 2, "mix_batches": 2}))
    trained = []
    train = learner._train  # noqa: SLF001 -- the learner's own step, observed

    async def observed(batch):
        trained.append(sorted(t.segment.group_id + str(t.segment.sample_idx) for t in batch))
        return await train(batch)

    learner._train = observed  # noqa: SLF001
    import msgspec

    arrived = [ScoredTrajectory(segment=msgspec.structs.replace(segment([20 + i, 21], pid=g), sample_idx=i, group_size=2),
                                score=float(i)) for g in "ab" for i in range(2)]

    async def run():
        await mailbox.put(arrived[:2])
        assert await learner.step_once(timeout=0.1) is None  # two held: not yet a mix
        await mailbox.put(arrived[2:])
        return await learner.step_once(timeout=0.1)

    record = asyncio.run(run())
    assert trained == [["a0", "b0"], ["a1", "b1"]]
    assert record["value_step"] == 2 and learner.counters["trajectories_trained"] == 4
    assert learner.stats()["pending_trajectories"] == 0


def test_value_model_from_a_process_reward_model_checkpoint(tmp_path):
    from transformers import LlamaForTokenClassification

    config = LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0,
                         architectures=["LlamaForTokenClassification"])
    prm = LlamaForTokenClassification(config).eval()
    prm.save_pretrained(tmp_path)
    value_model = value_model_from_reward_model(str(tmp_path))
    ids = torch.tensor([[5, 6, 7, 20, 21]])
    expected = prm(input_ids=ids).logits[0, :, 0]  # the PRM's own per-token score is the initial value
    got = predict_values(value_model, [segment_row(segment([20, 21]))], with_next=True)[0]
    np.testing.assert_allclose(got, expected[2:5].detach().numpy(), rtol=1e-4, atol=1e-5)


def test_a_value_batch_closes_after_its_nth_finished_row():
    from asyncrl.assembly.rows import cut_row_batch

    def row(finished):
        return TrainingRow(segment=segment([8], finished=finished), score=0.0, advantages=float32_array([0.0]))

    rows = [row(False), row(True), row(False), row(False), row(True), row(False)]
    assert cut_row_batch(rows, 2) == 5  # the windows that arrived before the 2nd finished row come along
    assert cut_row_batch(rows, 3) is None


def golden_value_trajectories():
    rng = np.random.default_rng(7)
    out = []
    for i in range(6):
        n = int(rng.integers(3, 9))
        seg = Segment(prompt_id=f"p{i}", sample_idx=0, window=0, group_id=f"p{i}", prompt_token_ids=int32_array(rng.integers(3, 30, 4)),
                      prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                      new_token_ids=int32_array(rng.integers(3, 30, n)), new_logprobs=float32_array([-1.0] * n),
                      new_versions=int32_array([0] * n), finished=True, finish_reason=FinishReason.EOS)
        values = float32_array(rng.normal(0.3, 0.2, n)) if i % 2 else None
        dense = float32_array(rng.normal(0, 0.05, n)) if i % 3 == 0 else None
        out.append(ScoredTrajectory(segment=seg, score=float(i % 2), token_rewards=dense, values=values))
    return out


@pytest.mark.parametrize("lam,loss,grad_norm,clip,bias", [
    # Recorded with the value step as it was before its extra forward pass was removed (which
    # recomputed the pre-step values of the whole batch in a separate no-grad pass).
    (1.0, 0.1855793586548637, 5.900639057159424, 0.26470588848871346, 0.08989445865154266),
    (0.9, 0.1258620492675725, 4.7723307609558105, 0.2058823625831043, 0.09104929864406586),
])
def test_the_value_step_without_its_extra_forward_pass_reproduces_the_golden_batch(lam, loss, grad_norm, clip, bias):
    torch.manual_seed(0)
    model = value_model_from_policy(build_tiny_model(ModelConfig(source="tiny", seed=3), 30))
    with torch.no_grad():
        model.head.bias.fill_(0.1)
        model.head.weight.normal_(0, 0.05)
    metrics = value_step(model, torch.optim.SGD(model.parameters(), lr=0.1), golden_value_trajectories(),
                         critic(lam, (0.2, 0.3), micro_batch_tokens=24), 1.0)
    assert metrics["value_loss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["value_grad_norm"] == pytest.approx(grad_norm, rel=1e-6)
    assert metrics["value_clip_fraction"] == pytest.approx(clip, rel=1e-6)
    assert model.head.bias.item() == pytest.approx(bias, rel=1e-6)
    # Explained variance on the critic as it is now, and on the values the rows were valued with.
    assert metrics["value_explained_variance"] != metrics["value_explained_variance_recorded"]
