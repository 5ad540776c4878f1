"""How the algorithms are wired, against docs/algorithms.md: each test here failed on the code before
issue 19 and checks one departure (staleness at the learner, dynamic sampling without a correctness
flag, the critic's return, NLL over every window, the learner's distribution, value clipping,
several updates per batch, the Dr.GRPO constant, the pairwise path, the KL estimators)."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from actors.assembler import Assembler
from actors.policy_learner import PolicyLearner
from asyncrl.algo.advantages import group_normalised, pairwise_advantages
from asyncrl.algo.losses import behaviour_weights, kl_penalty, ppo_policy_loss, rollout_mismatch
from asyncrl.algo.sampling import filtered_logprobs, step_logprobs
from asyncrl.assembly.decisions import Scored
from asyncrl.assembly.groups import PairwiseStrategy, group_rows
from asyncrl.assembly.rows import with_whole_response
from asyncrl.assembly.values import ValueEdges, ValueStrategy
from asyncrl.config import (ConfigError, CriticConfig, DynamicSampling, GAEAdvantage, KLPenalty, ModelConfig, Optimizer,
                            OverlongShaping, PolicyCompute, PolicyConfig, PolicyLoss, SamplingConfig, ValueLoss, compose)
from asyncrl.config.fields import replaced
from asyncrl.config.learner import Compute
from asyncrl.learning.policy import Objective, policy_step
from asyncrl.learning.rank import PolicyRank
from asyncrl.learning.scoring import token_logprobs
from asyncrl.learning.tensors import collate
from asyncrl.learning.value import value_step
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.messages.structs import (FinishReason, Reward, ScoredTrajectory, Segment, TrainBatch, TrainingRow, float32_array,
                                      int32_array)
from asyncrl.models.loading import build_tiny_model, value_model_from_policy
from asyncrl.staleness import mask_stale_tokens


def segment(new, prior=(), finished=True, pid="p", idx=0, version=0, prior_version=None, group_size=1, seed=0,
            logprobs=None):
    n = len(new)
    pv = version if prior_version is None else prior_version
    return Segment(prompt_id=pid, sample_idx=idx, window=1 if len(prior) else 0, group_id=pid, group_size=group_size,
                   prompt_token_ids=int32_array([5, 6, 7]), prior_response_ids=int32_array(list(prior)),
                   prior_versions=int32_array([pv] * len(prior)), new_token_ids=int32_array(new),
                   new_logprobs=float32_array(logprobs if logprobs is not None else [-2.0] * n),
                   new_versions=int32_array([version] * n), finished=finished, seed=seed,
                   finish_reason=FinishReason.EOS if finished else FinishReason.WINDOW, ground_truth="7",
                   data_source="tiny")


# Where each knob of a test's objective lives (the learner reads the run's sections as they are).
WHERE = {"loss_agg": "policy.loss.agg", "norm_tokens": "policy.loss.norm_tokens", "top_p": "sampling.top_p",
         "nll_coef": "nll_coef", "ppo_epochs": "policy.ppo_epochs", "mini_batches": "policy.mini_batches",
         "rollout_correction": "policy.loss.rollout_correction", "rollout_is_cap": "policy.loss.rollout_is_cap",
         "behaviour_weight_cap": "policy.loss.behaviour_weight_cap"}


def loss_settings(**changes) -> Objective:
    """The objective of a policy step: clip 0.2/0.28, no dual clip, token-mean, temperature 1, no
    gradient clip, fp32; `changes` by knob name (`WHERE`)."""
    base = Objective(PolicyConfig(loss=PolicyLoss(dual_clip=None), optimizer=Optimizer(grad_clip=1e9),
                                  compute=PolicyCompute(precision="fp32")), SamplingConfig(temperature=1.0), KLPenalty())
    return replaced(base, {WHERE[k]: v for k, v in changes.items()})


def tiny_policy(seed=3):
    return build_tiny_model(ModelConfig(source="tiny", seed=seed), 30)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def same_grads(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-7) for k in a)


GROUP = DynamicSampling(enabled=True)


def scored(samples, rewards, penalties=None):
    """Finished samples and their rewards as the estimators get them (score shaped by `penalties`)."""
    penalties = penalties or [0.0] * len(samples)
    return [Scored(s, r, r.score + p) for s, r, p in zip(samples, rewards, penalties)]


# --- 1. staleness is bounded where the batch is trained --------------------------------------------


def test_the_learner_masks_tokens_too_stale_for_the_weights_it_trains():
    """A batch assembled when it was fresh, trained after the learner moved on: the learner's own
    check masks what is now too old, reports the staleness of what it trained, and a batch with
    nothing left moves no weight (an Adam step on zero gradients would)."""
    async def main():
        model = tiny_policy()
        learner = PolicyLearner(PolicyRank(model, replaced(loss_settings(), {"policy.optimizer.lr": 1e-2})),
                                InProcessMailbox(10),
                                max_staleness_versions=2)
        learner.weight_version = learner.step = 10
        old = TrainingRow(segment=segment([20, 21, 22], version=7), score=1.0, advantages=float32_array([1.0] * 3))
        fresh = TrainingRow(segment=segment([23, 24], pid="q", version=9), score=1.0, advantages=float32_array([1.0] * 2))
        record = await learner.train_on(TrainBatch(batch_id="b0", rows=[old, fresh], stats={"staleness_max_assembled": 1.0}))
        assert record["staleness_max"] == 1 and record["stale_tokens_masked"] == 3 and record["tokens_trained"] == 2
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        record = await learner.train_on(TrainBatch(batch_id="b1", rows=[old], stats={}))
        assert record["stale_tokens_masked"] == 3 and record["skipped_updates"] == 1
        assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
        assert learner.counters["stale_tokens_masked"] == 6

    asyncio.run(main())


def test_a_long_response_loses_only_its_stale_windows_not_its_group():
    """Dropping a group by its oldest token dropped long responses (made over more versions) more
    often than short ones; now only the stale window of the long response leaves the loss."""
    long = segment([1, 2, 3, 4], pid="g", idx=0, group_size=2)
    long = Segment(**{**{f: getattr(long, f) for f in long.__struct_fields__},
                      "new_versions": int32_array([1, 1, 6, 6])})
    short = segment([7], pid="g", idx=1, group_size=2, version=6)
    rewards = [Reward(prompt_id="g", sample_idx=i, score=float(i), correct=bool(i), source="t") for i in range(2)]
    train, reason = group_rows(scored([long, short], rewards), GROUP, group_normalised)
    train, stats = mask_stale_tokens(train, 6, 4)  # as the assembler does when the batch leaves
    assert reason is None and train[0].loss_mask.tolist() == [0, 0, 1, 1] and train[1].loss_mask is None
    assert stats == {"staleness_max": 0.0, "stale_tokens_masked": 2.0}


# --- 2. dynamic sampling and positives without a correctness flag -----------------------------------


def test_dynamic_sampling_falls_back_to_the_score_without_a_correctness_flag():
    """A Bradley-Terry model gives scores and no `correct`: None counted as wrong made every group
    "no signal"."""
    group = [segment([1], pid="bt", idx=i, group_size=3) for i in range(3)]
    varied = [Reward(prompt_id="bt", sample_idx=i, score=s, source="bt") for i, s in enumerate([0.3, 1.2, -0.4])]
    train, reason = group_rows(scored(group, varied), GROUP, group_normalised)
    assert reason is None and len(train) == 3
    flat = [Reward(prompt_id="bt", sample_idx=i, score=0.5, source="bt") for i in range(3)]
    assert group_rows(scored(group, flat), GROUP, group_normalised)[1] == "no_signal"
    # metric=score: correctness all equal but the scores differ (partial credit): kept.
    partial = [Reward(prompt_id="bt", sample_idx=i, score=s, correct=False, source="v") for i, s in enumerate([0, .5, 0])]
    assert group_rows(scored(group, partial), GROUP, group_normalised)[1] == "no_signal"
    assert group_rows(scored(group, partial), DynamicSampling(metric="score"), group_normalised)[1] is None


def test_positive_example_nll_counts_a_positive_score_when_correctness_is_unknown():
    rows = [TrainingRow(segment=segment([20, 21]), score=s, advantages=float32_array([0.0, 0.0]), correct=None)
            for s in (0.8, -0.3)]
    collated = collate(rows)
    assert collated.nll_mask.sum(-1).tolist() == [2.0, 0.0]


# --- 3. the critic learns the reward the policy is trained with ------------------------------------


def value_estimator(gae: GAEAdvantage, value_of=lambda row: 0.25, nll=False, reference=None, kl=None,
                    window_tokens=2):
    async def values(rows, images=None):
        return [np.full(len(new) + 1, value_of(new), dtype=np.float32) for _, new in rows], 3

    async def ready():
        return True

    return ValueStrategy(edges=ValueEdges(values=values, ready=ready, reference_logprobs=reference), gae=gae,
                         window_tokens=window_tokens, rows_per_batch=1, nll_whole_response=nll, kl=kl)


def run_assembler(estimator, batches_of_segments, score=1.0, correct=True, shaping=OverlongShaping()):
    segments, batches, trajectories = InProcessMailbox(100), InProcessMailbox(100), InProcessMailbox(100)

    async def scorer(requests):
        return [Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=score, correct=correct, source="t")
                for r in requests]

    async def main():
        asm = Assembler(segments, batches, scorer, lambda ids: " ".join(map(str, ids)), estimator, shaping, 4,
                        max_staleness_versions=4, trajectories=trajectories)
        for group in batches_of_segments:
            await segments.put(group)
            for _ in range(3):
                await asm.step(timeout=0.01)
                await asyncio.sleep(0.01)
        return await batches.get(100, timeout=0.05), await trajectories.get(100, timeout=0.05)

    return asyncio.run(main())


TPPO = GAEAdvantage(gamma=1.0, lam=1.0, window_training=True)
# A 2-token overlong buffer at L_max = 4 (run_assembler's).
SHAPED = OverlongShaping(buffer_tokens=2)


def test_the_critic_learns_the_overlong_shaped_return():
    """A 4-token response at L_max=4 with a 2-token buffer earns 1 - 1 = 0: the policy's row says so,
    and so must the critic's target (T-PPO's early windows learn only through V)."""
    first, last = segment([1, 2], finished=False), segment([3, 4], prior=[1, 2])
    out, trajectories = run_assembler(value_estimator(TPPO), [[first], [last]], shaping=SHAPED)
    finished_rows = [s for b in out for s in b.rows if s.segment.finished]
    assert [r.score for r in finished_rows] == [0.0]
    assert [t.score for t in trajectories] == [0.0]


# --- 4. positive-example NLL over every window -------------------------------------------------------


def test_a_correct_response_imitates_every_window_and_the_policy_loss_only_its_last():
    first, last = segment([1, 2], finished=False), segment([3, 4], prior=[1, 2])
    out, _ = run_assembler(value_estimator(TPPO, nll=True), [[first], [last]], shaping=SHAPED)
    rows = {s.segment.finished: s for b in out for s in b.rows}
    whole = rows[True]
    assert whole.segment.new_token_ids.tolist() == [1, 2, 3, 4] and len(whole.segment.prior_response_ids) == 0
    assert whole.loss_mask.tolist() == [0, 0, 1, 1] and whole.advantages[:2].tolist() == [0.0, 0.0]
    collated = collate([whole])
    assert collated.nll_mask.sum().item() == 4 and collated.response_mask.sum().item() == 2
    # The learner's NLL moves with the first window's tokens (context before: no gradient there).
    model = tiny_policy()
    policy_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [whole],
                loss_settings(nll_coef=0.1))
    with_all = model.lm_head.weight.grad[1].abs().sum().item()  # token 1 is in the first window only
    model = tiny_policy()
    last_window_only = TrainingRow(segment=last, score=1.0, advantages=float32_array([0.0, 0.0]), correct=True)
    policy_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [last_window_only], loss_settings(nll_coef=0.1))
    last_only = model.lm_head.weight.grad[1].abs().sum().item()
    assert with_all > last_only
    assert with_whole_response(TrainingRow(segment=first, score=0.0, advantages=float32_array([0, 0]))).segment is first


# --- 5. the learner scores the distribution the tokens were sampled from --------------------------


def test_the_learner_scores_under_top_p_and_masks_fires_first_token():
    torch.manual_seed(0)
    model = tiny_policy()
    ids = torch.tensor([[5, 6, 7, 20, 21, 22]])
    logits = model(input_ids=ids).logits[0].detach()
    positions = torch.arange(6)
    behaviour = step_logprobs(logits, positions, temperature=1.0, top_p=0.7)
    targets = torch.tensor([[6, 7, 20, 21, 22, 0]])
    sampled = behaviour.gather(-1, targets[0][:, None]).squeeze(-1)
    keep = torch.isfinite(sampled)
    learner, _ = token_logprobs(model, ids, torch.ones_like(ids), targets, 1.0, top_p=0.7)
    np.testing.assert_allclose(learner[0][keep].detach().numpy(), sampled[keep].numpy(), atol=1e-5)
    full, _ = token_logprobs(model, ids, torch.ones_like(ids), targets, 1.0)
    assert bool((full[0][keep] < sampled[keep] - 1e-3).any())  # what the learner scored before: ratio != 1
    assert bool((learner[0][~keep] == -1e4).all()) if bool((~keep).any()) else True
    # The tokens the engine marked unscored (FIRE's hot first token; EOS held back below a minimum
    # length) are left out of the policy loss, the others are not.
    fire = segment([20, 21, 22])
    fire = Segment(**{**{f: getattr(fire, f) for f in fire.__struct_fields__}, "new_scored": np.array([0, 1, 1], np.uint8)})
    row = TrainingRow(segment=fire, score=1.0, advantages=float32_array([1.0] * 3))
    assert collate([row]).response_mask.sum().item() == 2
    window2 = TrainingRow(segment=segment([23], prior=[20, 21, 22]), score=1.0, advantages=float32_array([1.0]))
    assert collate([window2]).response_mask.sum().item() == 1
    assert filtered_logprobs(logits, 1.0, 0, 0.7).shape == logits.shape


def test_at_step_zero_every_ratio_is_one_under_the_engines_own_sampling():
    """Tokens generated by the real engine with top-p 0.8 and trained at once: no ratio may move off
    1 (before, every negative-advantage token fell outside the clip)."""
    from asyncrl.engines.base import SamplingParams, SequenceInput
    from asyncrl.engines.torch_engine import TorchEngine

    model = tiny_policy()
    engine = TorchEngine(model, eos_token_ids=[2], pad_token_id=0)
    params = SamplingParams(temperature=1.0, top_p=0.8)
    out = engine.generate_window_sync([SequenceInput(prompt_ids=int32_array([5, 6, 7]), response_ids=int32_array([]),
                                                     seed=11, max_response_tokens=12)], 12, params)[0]
    row = TrainingRow(segment=segment(out.token_ids.tolist(), logprobs=out.logprobs.tolist(), finished=True),
                      score=-1.0, advantages=float32_array([-1.0] * len(out.token_ids)))
    metrics = policy_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [row], loss_settings(top_p=0.8))
    assert metrics["clip_fraction"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)


# --- 6. value clipping around the recorded values ---------------------------------------------------


def test_value_clipping_acts_around_the_values_recorded_at_scoring():
    windows = segment([20, 21, 22, 23])
    critic = CriticConfig(loss=ValueLoss(lam=1.0, clip_low=0.5, clip_high=0.6), optimizer=Optimizer(grad_clip=1e9),
                          compute=Compute(precision="fp32"))

    def value_grads(trajectory, clip=True):
        torch.manual_seed(0)
        value_model = value_model_from_policy(tiny_policy())
        c = critic if clip else replaced(critic, {"loss.clip_low": None, "loss.clip_high": None})
        metrics = value_step(value_model, torch.optim.SGD(value_model.parameters(), lr=0.0), [trajectory], c, 1.0)
        return grads(value_model), metrics

    plain, _ = value_grads(ScoredTrajectory(segment=windows, score=1.0), clip=False)
    unrecorded, _ = value_grads(ScoredTrajectory(segment=windows, score=1.0))
    assert same_grads(plain, unrecorded)  # clip around the pre-step values: the plain squared error
    # Recorded 2.0 above the current values (0, zero head): the clipped branch is larger, and wins.
    recorded = ScoredTrajectory(segment=windows, score=1.0, values=float32_array([-2.0] * 4))
    clipped, metrics = value_grads(recorded)
    assert not same_grads(plain, clipped)
    assert metrics["value_clip_fraction"] == 1.0 and metrics["value_anchor_recorded_fraction"] == 1.0


def test_trajectories_carry_the_values_their_windows_were_valued_with():
    first, last = segment([1, 2], finished=False), segment([3, 4], prior=[1, 2])
    estimator = value_estimator(TPPO, value_of=lambda new: float(new[0]))
    _, trajectories = run_assembler(estimator, [[first], [last]])
    assert trajectories[0].values.tolist() == [1.0, 1.0, 3.0, 3.0]
    assert not estimator._recorded  # nothing kept after the response finished


# --- 7. several updates per batch, clipped around the proximal policy -------------------------------


def test_decoupled_loss_hand_values():
    """ρ = π_θ/π_prox is clipped; the token is weighted by π_prox/π_behav (capped)."""
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    prox = torch.zeros(1, 3)
    old = torch.log(torch.tensor([[0.5, 2.0, 0.01]]))  # weights 2, 0.5, 100 -> capped at 5
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    weights = behaviour_weights(prox, old, torch.ones(1, 3), "token_tis", 5.0)
    loss, metrics = ppo_policy_loss(logp, old, adv, torch.ones(1, 3), 0.2, 0.28, proximal_logp=prox,
                                    behaviour_weight=weights)
    # per token: -1·min(1.5, 1.28)·2 = -2.56; max(0.5, 0.8)·0.5 = 0.4; -1·1·5 = -5
    assert loss.item() == pytest.approx((-2.56 + 0.4 - 5.0) / 3, abs=1e-5)
    assert metrics["behaviour_weight_mean"] == pytest.approx((2 + 0.5 + 5) / 3, rel=1e-5)
    plain, _ = ppo_policy_loss(logp, prox, adv, torch.ones(1, 3), 0.2, 0.28)
    same, _ = ppo_policy_loss(logp, prox, adv, torch.ones(1, 3), 0.2, 0.28, proximal_logp=prox)
    assert same.item() == pytest.approx(plain.item())  # π_prox = π_behav: the plain loss


def test_epochs_and_mini_batches_take_several_updates_and_the_clip_engages():
    rng = np.random.default_rng(0)
    rows = [TrainingRow(segment=segment(rng.integers(3, 30, 6).tolist(), pid=f"p{i}"), score=1.0,
                        advantages=float32_array([1.0 if i % 2 else -1.0] * 6)) for i in range(8)]
    model = tiny_policy()
    # Behaviour log-probs = the current policy's, so the first update starts at ratio 1.
    collated = collate(rows)
    with torch.no_grad():
        logp, _ = token_logprobs(model, collated.input_ids, collated.attention_mask, collated.targets, 1.0)
    rows = [TrainingRow(segment=segment(r.segment.new_token_ids.tolist(), pid=r.segment.prompt_id,
                                        logprobs=logp[i, 2:8].tolist()), score=1.0, advantages=r.advantages)
            for i, r in enumerate(rows)]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    metrics = policy_step(model, optimizer, rows, loss_settings(ppo_epochs=2, mini_batches=2))
    assert metrics["policy_updates"] == 4
    assert next(iter(optimizer.state.values()))["step"] == 4
    assert metrics["approx_kl_first_update"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["clip_fraction_last_update"] > 0  # the trust region at work within the batch


@pytest.mark.parametrize("epochs, minis, correction", [(1, 2, "none"), (2, 2, "none"), (2, 1, "none"),
                                                        (1, 1, "token_tis"), (1, 2, "sequence_mis")])
def test_the_first_update_anchors_on_its_own_forward_as_on_a_separate_proximal_one(epochs, minis, correction):
    """π_prox is the weights before the batch's first update: the step takes the first update's rows'
    log-probs from that update's own forward (and scores only the other rows beforehand). The same
    weights and metrics as scoring every row in a forward of its own first, then training each update
    against it (`_policy_update` with the proximal log-probs given)."""
    from asyncrl.learning.policy import _behaviour_correction, _policy_update, proximal_logprobs
    from asyncrl.learning.tensors import mini_batch_rows, row_length

    rng = np.random.default_rng(1)
    rows = [TrainingRow(segment=segment(rng.integers(3, 30, n).tolist(), pid=f"p{i}"), score=1.0,
                        advantages=float32_array(rng.normal(size=n))) for i, n in enumerate([3, 6, 4, 7, 5, 2, 6, 8])]
    start = tiny_policy()
    collated = collate(rows)
    with torch.no_grad():  # behaviour log-probs off the learner's by up to a nat: the weights matter
        logp, _ = token_logprobs(start, collated.input_ids, collated.attention_mask, collated.targets, 1.0)
    rows = [TrainingRow(segment=segment(r.segment.new_token_ids.tolist(), pid=r.segment.prompt_id,
                                        logprobs=(logp[i, 2:2 + len(r.advantages)].numpy()
                                                  + rng.uniform(-1.0, 1.0, len(r.advantages))).tolist()),
                        score=1.0, advantages=r.advantages) for i, r in enumerate(rows)]
    settings = loss_settings(ppo_epochs=epochs, mini_batches=minis, rollout_correction=correction,
                             behaviour_weight_cap=1.5, rollout_is_cap=1.5)
    model, reference = copy.deepcopy(start), copy.deepcopy(start)
    metrics = policy_step(model, torch.optim.Adam(model.parameters(), lr=3e-2), rows, settings)

    optimizer = torch.optim.Adam(reference.parameters(), lr=3e-2)
    ordered = collate(sorted(rows, key=lambda r: row_length(r.segment)))
    proximal = proximal_logprobs(reference, ordered, settings.policy, settings.sampling)
    weights_correction = _behaviour_correction(settings.policy.loss, epochs * minis)
    assert weights_correction is not None
    history = [_policy_update(reference, optimizer, ordered.select(part), settings, None, proximal[part],
                              weights_correction)[0]
               for _ in range(epochs) for part in mini_batch_rows(len(rows), minis)]
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(got, want, atol=1e-6), name
    assert metrics["behaviour_weight_mean"] == pytest.approx(np.mean([h["behaviour_weight_mean"] for h in history]),
                                                             rel=1e-5)
    assert metrics["clip_fraction_last_update"] == pytest.approx(history[-1]["clip_fraction"], abs=1e-6)
    whole = rollout_mismatch(proximal, ordered.old_logprobs, ordered.response_mask)
    for key in ("rollout_kl_k1", "rollout_kl_k3", "rollout_ratio_max", "rollout_ratio_min"):
        assert metrics[key] == pytest.approx(whole[key], rel=1e-5), key


# --- 9. the Dr.GRPO constant ----------------------------------------------------------------------


def test_seq_mean_token_sum_norm_divides_by_a_fixed_length():
    """A longer row with zero advantage in the batch must not rescale the others' gradient."""
    short = TrainingRow(segment=segment([20, 21]), score=1.0, advantages=float32_array([1.0, 1.0]))
    longer = TrainingRow(segment=segment(list(range(8, 20)), pid="q"), score=0.0, advantages=float32_array([0.0] * 12))

    def step(rows):
        model = tiny_policy()
        policy_step(model, torch.optim.SGD(model.parameters(), lr=0.0), rows,
                    loss_settings(loss_agg="seq-mean-token-sum-norm", norm_tokens=16))
        return grads(model)

    assert same_grads(step([short]), step([short, longer]))


# --- 10. smaller departures ------------------------------------------------------------------------


def test_pairwise_advantages_carry_the_overlong_penalty():
    """The judge ties the two responses; the 8-token one (L_max 8, buffer 4) carries its penalty of -1."""
    async def judge(pairs):
        return [{"p_first": 0.5, "consistent": True, "failed": False} for _ in pairs]

    estimator = PairwiseStrategy(DynamicSampling(enabled=False), 1, pairwise_advantages, judge=judge,
                                  decode=lambda ids: " ".join(map(str, ids)))
    group = [segment([1] * 8, pid="pw", idx=0, group_size=2), segment([1] * 2, pid="pw", idx=1, group_size=2)]
    rewards = [Reward(prompt_id="pw", sample_idx=i, score=0.0, correct=False, source="t") for i in range(2)]
    decision = asyncio.run(estimator.decide([], scored(group, rewards, penalties=[-1.0, 0.0])))
    rows = decision.batches[0].rows
    assert rows[0].advantages[0] == pytest.approx(-1.0) and rows[1].advantages[0] == 0.0


def test_a_failed_judgement_drops_the_group_instead_of_a_neutral_tie():
    async def judge(pairs):
        return [{"p_first": 0.5, "consistent": True, "failed": i == 0} for i, _ in enumerate(pairs)]

    estimator = PairwiseStrategy(GROUP, 1, pairwise_advantages, judge=judge, decode=lambda ids: " ".join(map(str, ids)))
    group = [segment([1], pid="j", idx=i, group_size=2) for i in range(2)]
    out, _ = run_assembler_group(estimator, group)
    assert out == [] and estimator._groups == {}


def run_assembler_group(estimator, group):
    segments, batches, events = InProcessMailbox(100), InProcessMailbox(100), []

    async def scorer(requests):
        return [Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=float(r.sample_idx), correct=bool(r.sample_idx),
                       source="t") for r in requests]

    async def main():
        asm = Assembler(segments, batches, scorer, lambda ids: " ".join(map(str, ids)), estimator, OverlongShaping(), 8,
                        events=lambda evs, outcomes: events.extend((state, reason) for _, state, reason in evs))
        await segments.put(group)
        for _ in range(3):
            await asm.step(timeout=0.01)
            await asyncio.sleep(0.01)
        assert ("dropped", "reward_failed") in events
        return await batches.get(100, timeout=0.05), events

    return asyncio.run(main())


def test_the_reference_anchor_is_a_response_not_a_bare_answer():
    from asyncrl.data.tasks import reference_response

    assert reference_response("arithmetic", "42") == "The answer is \\boxed{42}."
    assert reference_response("tiny", "7") == "7"


def test_kl_estimators_are_selectable():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(np.exp(-0.5) + 0.5 - 1)
    assert compose(["algorithm.kl.estimator=k2"]).algorithm.kl.estimator == "k2"
    with pytest.raises(ConfigError, match="algorithm.kl.estimator"):
        compose(["algorithm.kl.estimator=k4"])


def test_tppo_refuses_process_rewards_it_cannot_credit():
    with pytest.raises(ConfigError, match="process rewards"):
        compose(["algorithm=tppo", "+reward.endpoints.prm={kind: prm, model_path: prm_dir}",
                 "reward.routes=[{match: '*', endpoints: [verifier], dense: [prm]}]"])


def test_vapo_lambda_is_scaled_to_the_embedded_response_length():
    """α=0.05 was the paper's for responses of thousands of tokens; at 64 it gave λ = 0 up to 20
    tokens. The config keeps λ ≥ 0.95 from 20 tokens on, as the paper's λ is from 400."""
    from asyncrl.algo.advantages import length_adaptive_lambda

    config = compose(["algorithm=vapo"])
    lam = length_adaptive_lambda(torch.tensor([20.0, 64.0]), config.algorithm.advantage.length_adaptive_alpha)
    assert lam[0].item() >= 0.95 - 1e-9 and lam[1].item() > lam[0].item()


# --- 10. the PPO baseline's KL in the reward ---------------------------------------------------------


def test_kl_reward_hand_values_and_it_enters_gae_and_the_critics_return():
    from asyncrl.algo.shaping import kl_reward
    from asyncrl.assembly.rows import kl_rewards, value_rows

    # k1: KL_t = log π_old − log π_ref = [0.5, −1.0]; r_t = −0.1·KL_t = [−0.05, 0.1].
    out = kl_reward(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), 0.1, "k1")
    assert out.tolist() == pytest.approx([-0.05, 0.1])
    # FIRE's hot first token is not π_old's (the engine marked it unscored): no KL reward there.
    row = segment([4, 5], logprobs=[-1.0, -2.0])
    hot = Segment(**{**{f: getattr(row, f) for f in row.__struct_fields__}, "new_scored": np.array([0, 1], np.uint8)})
    fire = kl_rewards(hot, np.array([-1.5, -1.0]), KLPenalty(coef=0.1, estimator="k1"))
    assert fire.tolist() == pytest.approx([0.0, 0.1])
    # GAE with γ = λ = 1 and V ≡ 0: each advantage is the sum of the rewards to come, R = 1 included.
    gae = GAEAdvantage(gamma=1.0, lam=1.0)
    kl = kl_rewards(row, np.array([-1.5, -1.0]), KLPenalty(coef=0.1, estimator="k1"))
    from asyncrl.assembly.rows import Outcome
    trained = value_rows([row], [np.zeros(3, dtype=np.float32)], [Outcome(1.0, True)], gae, 8, 0, [kl])
    assert trained[0].advantages.tolist() == pytest.approx([-0.05 + 0.1 + 1.0, 0.1 + 1.0])

    # Through the estimator: rows and the critic's trajectory carry the same KL rewards.
    async def reference(rows, images=None):
        return [np.full(len(new), -1.5, dtype=np.float32) for _, new in rows]

    estimator = value_estimator(gae, reference=reference, kl=KLPenalty(coef=0.1, estimator="k1"), window_tokens=8)
    out, trajectories = run_assembler(estimator, [[segment([4, 5], logprobs=[-1.0, -2.0])]])
    expected = [-0.05, 0.05]  # KL = [0.5, −0.5]
    assert trajectories[0].token_rewards.tolist() == pytest.approx(expected)
    v = 0.25  # value_estimator's constant V: the advantages are rewards-to-go minus V
    assert out[0].rows[0].advantages.tolist() == pytest.approx([-0.05 + 0.05 + 1.0 - v, 0.05 + 1.0 - v])


def test_the_value_learner_scores_the_reference_under_the_samplers_distribution():
    """A reference equal to the behaviour policy: KL 0 on tokens the real engine sampled under top-p."""
    from asyncrl.engines.base import SamplingParams, SequenceInput
    from asyncrl.engines.torch_engine import TorchEngine
    from actors.value_learner import ValueLearner
    from asyncrl.assembly.rows import kl_rewards

    params = SamplingParams(temperature=0.7, top_p=0.8)
    engine = TorchEngine(tiny_policy(), eos_token_ids=[2], pad_token_id=0)
    out = engine.generate_window_sync([SequenceInput(prompt_ids=int32_array([5, 6, 7]), response_ids=int32_array([]),
                                                     seed=3, max_response_tokens=10)], 10, params)[0]
    critic = CriticConfig(loss=ValueLoss(lam=1.0, clip_low=None, clip_high=None), optimizer=Optimizer(lr=1e-3),
                          batch_trajectories=1)
    learner = ValueLearner(value_model_from_policy(tiny_policy()), InProcessMailbox(4),
                           replaced(critic, {"compute.micro_batch_tokens": 64, "compute.precision": "fp32"}),
                           reference=tiny_policy(), sampling=SamplingConfig(temperature=0.7, top_p=0.8))
    row = segment(out.token_ids.tolist(), logprobs=out.logprobs.tolist())
    (reference,) = asyncio.run(learner.reference_logprobs([(row.prompt_token_ids, row.new_token_ids)]))
    np.testing.assert_allclose(reference, out.logprobs, atol=1e-4)
    assert np.abs(kl_rewards(row, reference, KLPenalty(coef=0.5, estimator="k1"))).max() < 1e-4
    with pytest.raises(ConfigError, match="kl_in_reward"):
        compose(["algorithm=grpo", "algorithm.advantage.kl_in_reward=true", "algorithm.kl.coef=0.01"])
    assert compose(["algorithm=ppo", "algorithm.advantage.kl_in_reward=true", "algorithm.kl.coef=0.05"]).algorithm.kl_in_reward


# --- issue 18: rollout-training mismatch, measured and corrected --------------------------------------


def test_behaviour_weights_truncate_or_mask_per_token_or_per_sequence():
    prox = torch.zeros(2, 3)
    behav = torch.log(torch.tensor([[0.25, 1.0, 4.0], [0.5, 0.5, 1.0]]))  # r = [4, 1, .25], [2, 2, 1]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = lambda mode: behaviour_weights(prox, behav, mask, mode, 2.0).flatten().tolist()  # noqa: E731
    assert w("token_tis") == pytest.approx([2.0, 1.0, 0.25, 2.0, 2.0, 0.0])
    assert w("token_mis") == pytest.approx([0.0, 1.0, 0.0, 2.0, 2.0, 0.0])
    # Row ratios: 4·1·0.25 = 1 and 2·2 = 4 (the masked token does not count).
    assert w("sequence_tis") == pytest.approx([1.0, 1.0, 1.0, 2.0, 2.0, 0.0])
    assert w("sequence_mis") == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="unknown behaviour correction"):
        behaviour_weights(prox, behav, mask, "tis", 2.0)


def test_rollout_mismatch_hand_values():
    from asyncrl.algo.losses import rollout_mismatch

    # r = π_learner/π_behaviour = [2, 0.5]: k1 = mean(−log r) = 0; k3 = mean(r − log r − 1) =
    # ((2 − 0.6931 − 1) + (0.5 + 0.6931 − 1)) / 2 = 0.25.
    m = rollout_mismatch(torch.zeros(1, 2), torch.log(torch.tensor([[0.5, 2.0]])), torch.ones(1, 2))
    assert m["rollout_kl_k1"] == pytest.approx(0.0, abs=1e-7) and m["rollout_kl_k3"] == pytest.approx(0.25, abs=1e-6)
    assert m["rollout_ratio_max"] == pytest.approx(2.0) and m["rollout_ratio_min"] == pytest.approx(0.5)


def test_the_learner_reports_the_mismatch_every_step_and_corrects_it_when_asked():
    from asyncrl.engines.base import SamplingParams, SequenceInput
    from asyncrl.engines.torch_engine import TorchEngine

    engine = TorchEngine(tiny_policy(), eos_token_ids=[2], pad_token_id=0)
    out = engine.generate_window_sync([SequenceInput(prompt_ids=int32_array([5, 6, 7]), response_ids=int32_array([]),
                                                     seed=4, max_response_tokens=8)], 8, SamplingParams())[0]
    n = len(out.token_ids)
    row = lambda logprobs: TrainingRow(segment=segment(out.token_ids.tolist(), logprobs=logprobs),  # noqa: E731
                                       score=1.0, advantages=float32_array([1.0] * n))
    step = lambda logprobs, **kw: policy_step(tiny_policy(), torch.optim.SGD(tiny_policy().parameters(), lr=0.0),  # noqa: E731
                                              [row(logprobs)], loss_settings(**kw))
    same = step(out.logprobs.tolist())  # the engine's own model and distribution: no mismatch
    assert same["rollout_kl_k3"] < 1e-6 and same["rollout_ratio_max"] == pytest.approx(1.0, abs=1e-4)
    # An engine whose log-probs are log 3 below the learner's on every token (another kernel, say):
    # reported; with token-TIS each token's weight is r = π_learner/π_engine = 3, capped at 2.
    off = (out.logprobs - np.log(3.0)).tolist()
    plain = step(off)
    assert plain["rollout_ratio_max"] == pytest.approx(3.0, rel=1e-4) and plain["rollout_kl_k3"] > 0.5
    corrected = step(off, rollout_correction="token_tis", rollout_is_cap=2.0)
    assert corrected["behaviour_weight_mean"] == pytest.approx(2.0, rel=1e-4)
    # The clip is taken around the recomputed (proximal) log-probs: every ratio is 1 at the first update.
    assert corrected["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and plain["ratio_mean"] == pytest.approx(3.0, rel=1e-3)


def test_the_gpu_learners_settings_run_on_cpu_bf16_autocast_and_checkpointing():
    """bf16 autocast (fp32 master weights) and gradient checkpointing through the learner's own
    builder; on a CPU box they run on the CPU (the same code takes the GPU with policy.compute.device=cuda)."""
    from actors.policy_learner import build_policy_learner

    def step(*overrides):
        config = compose(["model=tiny", "task=tiny", "algorithm=grpo", *overrides])
        learner = build_policy_learner(config.model, config.algorithm, config.policy, config.engine, config.sampling,
                                       config.trainer.seed, InProcessMailbox(2))
        rows = [TrainingRow(segment=segment([20, 21, 22], logprobs=[-3.0] * 3), score=1.0,
                            advantages=float32_array([1.0, 1.0, 1.0]))]
        return learner, learner.policy.step(rows)  # the learner's own step

    auto, fp32 = step()  # policy.compute.precision=auto: the tiny model is too small for bf16 to pay
    assert auto.policy.objective.policy.compute.precision == "fp32" and auto.stats()["precision"] == "fp32"
    assert "under 10M" in auto.stats()["precision_choice"]["reason"]  # how auto chose (asyncrl.models.precision)
    learner, bf16 = step("policy.compute.precision=bf16", "policy.compute.gradient_checkpointing=true")
    assert learner.policy.objective.policy.compute.precision == "bf16" and learner.model.is_gradient_checkpointing
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())  # master weights stay fp32
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.05) and np.isfinite(bf16["grad_norm"])
    with pytest.raises(ConfigError, match="policy.compute.gpus"):
        compose(["policy.compute.device=cuda"])


def test_roles_ask_ray_for_what_they_use(ray_session):
    from ray.util.placement_group import remove_placement_group

    from asyncrl.run.placement import ask, role_placement

    def placed(*overrides, generators=2, learners=2):
        c = compose(["model=tiny", *overrides])
        return role_placement(c.cluster.placement, ask(c.engine.gpus, c.engine.resources), generators,
                              [ask(c.policy.compute.gpus, c.policy.compute.resources)] * learners)

    generators, learners, group = placed("engine.resources={node_generator: 1}", "policy.compute.gpus=0.5")
    assert group is None and generators == [{"resources": {"node_generator": 1.0}}] * 2
    assert learners == [{"num_gpus": 0.5}] * 2
    generators, learners, group = placed("cluster.placement=spread", learners=1)
    try:
        assert group.bundle_count == 2 and [g["scheduling_strategy"].placement_group_bundle_index for g in generators] == [0, 1]
        assert "scheduling_strategy" not in learners[0]  # spread: the learner is placed on its own
    finally:
        remove_placement_group(group)
    generators, learners, group = placed("cluster.placement=colocated", generators=1)
    try:
        assert group.bundle_count == 3 and learners[1]["scheduling_strategy"].placement_group_bundle_index == 2
    finally:
        remove_placement_group(group)


def test_the_sglang_engine_group_composes_and_sets_the_mismatch_correction():
    config = compose(["engine=sglang", "engine.device=cuda", "model.source=hf", "model.path=/models/qwen"])
    assert config.engine.name == "sglang" and config.policy.loss.rollout_correction == "token_tis"
    assert config.policy.compute.precision == "bf16" and config.engine.gpus > 0
    assert compose([]).engine.name == "torch" and compose([]).policy.loss.rollout_correction == "none"
