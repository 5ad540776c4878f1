"""The policy step: micro-batching does not change the gradient; only new tokens are trained."""

import copy

import numpy as np
import pytest
import torch

from asyncrl.config import KLPenalty, Optimizer, PolicyCompute, PolicyConfig, PolicyLoss, SamplingConfig
from asyncrl.config import ModelConfig
from asyncrl.learning.policy import Objective, policy_step
from asyncrl.learning.scoring import token_logprobs
from asyncrl.learning.tensors import collate
from asyncrl.messages.structs import FinishReason, Segment, TrainingRow, float32_array, int32_array
from asyncrl.models.loading import build_tiny_model


def sample(i, prompt_len, prior_len, new_len, adv):
    rng = np.random.default_rng(i)
    return TrainingRow(
        segment=Segment(prompt_id=f"p{i}", sample_idx=0, window=1 if prior_len else 0, group_id=f"p{i}",
                        prompt_token_ids=int32_array(rng.integers(3, 30, prompt_len)),
                        prior_response_ids=int32_array(rng.integers(3, 30, prior_len)),
                        prior_versions=int32_array([0] * prior_len),
                        new_token_ids=int32_array(rng.integers(3, 30, new_len)),
                        new_logprobs=float32_array(-rng.random(new_len) - 2.5),
                        new_versions=int32_array([0] * new_len), finished=True, finish_reason=FinishReason.EOS),
        score=adv, advantages=float32_array([adv] * new_len))


SAMPLES = [sample(0, 3, 0, 5, 1.0), sample(1, 6, 4, 2, -0.5), sample(2, 2, 0, 9, 0.7), sample(3, 4, 2, 1, -1.2)]


def settings(agg, micro_tokens, kl=0.0):
    policy = PolicyConfig(loss=PolicyLoss(clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=agg),
                          optimizer=Optimizer(grad_clip=1e9),
                          compute=PolicyCompute(micro_batch_tokens=micro_tokens, precision="fp32"))
    return Objective(policy, SamplingConfig(temperature=1.0), KLPenalty(coef=kl))


def grads_after_step(agg, micro_tokens, kl=0.0):
    model = build_tiny_model(ModelConfig(source="tiny", seed=5), 30)
    reference = copy.deepcopy(model) if kl else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: keep the weights, inspect the grads
    metrics = policy_step(model, optimizer, SAMPLES, settings(agg, micro_tokens, kl), reference)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, metrics


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batching_gives_the_full_batch_gradient(agg):
    full, m_full = grads_after_step(agg, micro_tokens=10_000)
    split, m_split = grads_after_step(agg, micro_tokens=12)  # one row per micro-batch
    for name in full:
        torch.testing.assert_close(split[name], full[name], rtol=1e-4, atol=1e-6)
    assert m_full["tokens_trained"] == 17 and m_split["rows_trained"] == 4


def test_only_new_tokens_are_scored():
    c = collate(SAMPLES)
    assert c.response_mask.sum(-1).tolist() == [5, 2, 9, 1]
    # Row 1: prompt 6 + prior 4 tokens are context; its 2 new tokens are predicted at positions 9 and 10.
    assert c.response_mask[1].nonzero().flatten().tolist() == [9, 10]
    assert c.targets[1, 9:11].tolist() == SAMPLES[1].segment.new_token_ids.tolist()


def test_kl_to_reference_is_zero_at_the_start_and_reported():
    _, metrics = grads_after_step("token-mean", 10_000, kl=0.1)
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-7)


def test_logprobs_use_the_sampling_temperature():
    model = build_tiny_model(ModelConfig(source="tiny", seed=5), 30)
    c = collate(SAMPLES[:1])
    lp1, _ = token_logprobs(model, c.input_ids, c.attention_mask, c.targets, 1.0)
    lp2, _ = token_logprobs(model, c.input_ids, c.attention_mask, c.targets, 0.5)
    logits = model(input_ids=c.input_ids).logits[0, 2]
    expected = torch.log_softmax(logits / 0.5, -1)[c.targets[0, 2]]
    assert float(lp2[0, 2]) == pytest.approx(float(expected), abs=1e-5)
    assert not torch.allclose(lp1, lp2)


def test_head_on_trained_positions_only_matches_the_full_forward():
    model = build_tiny_model(ModelConfig(source="tiny", seed=5), 30)
    c = collate(SAMPLES)
    full, full_entropy = token_logprobs(model, c.input_ids, c.attention_mask, c.targets, 0.7, with_entropy=True)
    fast, fast_entropy = token_logprobs(model, c.input_ids, c.attention_mask, c.targets, 0.7, with_entropy=True,
                                        positions=c.response_mask > 0)
    m = c.response_mask > 0
    torch.testing.assert_close(fast[m], full[m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_entropy[m], full_entropy[m], rtol=1e-5, atol=1e-5)
    assert bool((fast[~m] == 0).all())
    fast.sum().backward()  # gradients flow through the selected positions
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (7, 0.9)])
def test_the_head_in_chunks_gives_the_same_logprobs_entropy_and_gradients(top_k, top_p):
    """`chunk_tokens`: the vocabulary projected a few positions at a time and recomputed in the
    backward: the same numbers as all at once, forward and backward (17 positions in chunks of 5,
    the last one short)."""
    c = collate(SAMPLES)
    m = c.response_mask > 0
    results = []
    for chunk in (0, 5):
        model = build_tiny_model(ModelConfig(source="tiny", seed=5), 30)
        logp, entropy = token_logprobs(model, c.input_ids, c.attention_mask, c.targets, 0.7, with_entropy=True,
                                       positions=m, top_k=top_k, top_p=top_p, chunk_tokens=chunk)
        ((logp * c.advantages).sum() + 0.3 * entropy.sum()).backward()
        results.append((logp, entropy, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (logp0, ent0, grads0), (logp5, ent5, grads5) = results
    torch.testing.assert_close(logp5, logp0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent5, ent0, rtol=1e-6, atol=1e-6)
    assert grads5.keys() == grads0.keys() and "lm_head.weight" in grads0
    for name in grads0:
        torch.testing.assert_close(grads5[name], grads0[name], rtol=1e-4, atol=1e-6)  # summed in another order
    with torch.no_grad():  # no backward to keep anything for: chunks without the recompute
        nograd, _ = token_logprobs(model, c.input_ids, c.attention_mask, c.targets, 0.7, positions=m, chunk_tokens=5)
    assert bool((nograd[m] != 0).all())


def test_rows_are_laid_out_and_values_placed_at_each_rows_new_token_positions():
    """Hand-built: contexts of 2, 1 and 3 tokens with 2, 0 and 1 new tokens; a value for new token
    j of a row sits at the position before it (its logits predict it)."""
    from asyncrl.learning.tensors import layout_rows

    layout = layout_rows([(np.array([5, 6]), np.array([7, 8])), (np.array([9]), np.array([], dtype=np.int64)),
                          (np.array([1, 2, 3]), np.array([4]))], pad_token_id=0)
    assert layout.input_ids.tolist() == [[5, 6, 7, 8], [9, 0, 0, 0], [1, 2, 3, 4]]
    assert layout.attention_mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    placed = layout.place([np.array([0.5, 1.5]), np.array([]), np.array([2.5])])
    assert placed.tolist() == [[0, 0.5, 1.5, 0], [0, 0, 0, 0], [0, 0, 2.5, 0]]
    assert layout.place([np.array([3, 4]), np.array([]), np.array([5])], torch.long).dtype == torch.long
    with pytest.raises(ValueError, match="do not match"):  # one too few in row 0
        layout.place([np.array([1.0]), np.array([]), np.array([2.0])])
    with pytest.raises(ValueError, match="do not match"):  # the right total, shifted between rows
        layout.place([np.array([1.0]), np.array([]), np.array([2.0, 3.0])])
    with pytest.raises(ValueError, match="at least one context"):
        layout_rows([(np.array([], dtype=np.int64), np.array([1]))])


def test_the_learners_adamw_is_fused_and_steps_as_the_reference_adamw():
    """`adamw` (every learner's optimizer): one fused kernel over plain parameters, the same update as
    torch's reference AdamW to float rounding."""
    from asyncrl.learning.tensors import adamw

    model = build_tiny_model(ModelConfig(source="tiny", seed=3), 30)
    reference = copy.deepcopy(model)
    fused, plain = adamw(model.parameters(), 1e-2, 0.1), torch.optim.AdamW(reference.parameters(), lr=1e-2,
                                                                            weight_decay=0.1)
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    start = [p.detach().clone() for p in model.parameters()]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for a, b in zip(model.parameters(), reference.parameters()):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        fused.step()
        plain.step()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert all(not torch.equal(a, s) for a, s in zip(model.parameters(), start))  # every tensor moved


def test_the_learning_rate_schedules_warm_up_then_decay_to_their_floor_by_hand():
    """`policy.optimizer.schedule`: lr 1.0, 2 warm-up steps, decay to 0.2 x lr at step 6, held after.
    linear from step 2: 1 - 0.8 x k/4; cosine: 0.2 + 0.8 x (1 + cos(pi k/4))/2 (k = step - 2)."""
    from asyncrl.learning.tensors import build_optimizer

    by_hand = {"constant": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
               "linear": [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2],
               "cosine": [0.5, 1.0, 1.0, 0.2 + 0.4 * (1 + 0.5 ** 0.5), 0.6, 0.2 + 0.4 * (1 - 0.5 ** 0.5), 0.2, 0.2]}
    for schedule, expected in by_hand.items():
        weight = torch.nn.Parameter(torch.zeros(2))
        adam, scheduler = build_optimizer([weight], Optimizer(lr=1.0, warmup_steps=2, schedule=schedule,
                                                              min_lr_ratio=0.2, decay_steps=6))
        seen = []
        for _ in expected:  # as a learner steps: the optimizer, then the schedule, once per batch
            seen.append(adam.param_groups[0]["lr"])
            weight.grad = torch.ones(2)
            adam.step()
            scheduler.step()
        assert seen == pytest.approx(expected, abs=1e-12), schedule


def test_a_decaying_schedule_ends_at_the_runs_last_step_and_takes_verls_and_trls_names():
    """`asyncrl train` and `mode=learn` decay over trainer.total_steps unless told (`with_decay_horizon`,
    at composition); the Serve app trains until stopped, so it needs the horizon said."""
    from asyncrl.config import ConfigError, compose
    from asyncrl.serve.train import build_train

    foreign = ["model=tiny", "task=tiny", "trainer.total_steps=300", "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
               "actor_rollout_ref.actor.optim.min_lr_ratio=0.1"]
    optimizer = compose(foreign).policy.optimizer
    assert (optimizer.schedule, optimizer.min_lr_ratio, optimizer.decay_steps) == ("cosine", 0.1, 300)
    assert compose(foreign, until_stopped=True).policy.optimizer.decay_steps == 0  # a service: no horizon
    assert compose(["model=tiny", "task=tiny", "lr_scheduler_type=linear",
                    "policy.optimizer.decay_steps=50"]).policy.optimizer.decay_steps == 50
    assert compose(["model=tiny", "task=tiny"]).policy.optimizer.decay_steps == 0  # constant: no horizon
    with pytest.raises(ConfigError, match="the train app runs until stopped .* set policy.optimizer.decay_steps"):
        build_train({"overrides": "model=tiny task=tiny policy.optimizer.schedule=cosine"})
    with pytest.raises(ConfigError, match="policy.optimizer.decay_steps=10 must be past its warmup_steps=20"):
        compose(["model=tiny", "task=tiny", "lr_scheduler_type=linear", "policy.optimizer.decay_steps=10",
                 "policy.optimizer.warmup_steps=20"])
    with pytest.raises(ConfigError, match="lr_scheduler_type=cosine_with_restarts has no counterpart here"):
        compose(["model=tiny", "task=tiny", "lr_scheduler_type=cosine_with_restarts"])
    # The critic's steps follow its own pace: a decay needs its horizon said.
    with pytest.raises(ConfigError, match="critic.optimizer.schedule=cosine needs critic.optimizer.decay_steps"):
        compose(["model=tiny", "task=tiny", "algorithm=ppo", "critic.optim.lr_scheduler_type=cosine"])
    assert compose(["model=tiny", "task=tiny", "algorithm=ppo", "critic.optimizer.schedule=linear",
                    "critic.optimizer.decay_steps=80"]).critic.optimizer.decay_steps == 80
