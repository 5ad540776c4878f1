"""The sharded policy learner (FSDP2 over gloo, two CPU processes): one sharded step is the one-rank
step, its checkpoint state is the one-rank format, and a run trains through two ranks end to end."""

from __future__ import annotations

import os
import pickle

import msgspec
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.config import ModelConfig
from asyncrl.config import KLPenalty, Optimizer, PolicyCompute, PolicyConfig, PolicyLoss, SamplingConfig
from asyncrl.learning.policy import Objective
from asyncrl.learning.rank import PolicyRank
from asyncrl.messages.structs import FinishReason, Segment, TrainingRow, float32_array, int32_array
from asyncrl.models.loading import build_tiny_model
from asyncrl.weights.sharding import DataParallel, join, leave, parts_of_rank, rendezvous_store
from asyncrl.weights.sync import free_port


def test_micro_batches_are_dealt_round_robin_and_short_shares_get_a_ghost():
    parts = ["a", "b", "c", "d", "e"]
    assert parts_of_rank(parts, None) == [(p, False) for p in parts]
    assert parts_of_rank(parts, DataParallel(0, 2)) == [("a", False), ("c", False), ("e", False)]
    assert parts_of_rank(parts, DataParallel(1, 2)) == [("b", False), ("d", False), ("a", True)]
    # Fewer parts than ranks: the idle rank still runs one (ghost) forward and backward.
    assert parts_of_rank(["a"], DataParallel(1, 2)) == [("a", True)]


def _settings() -> Objective:
    # Tiny micro-batches (several per rank, an odd count: a ghost), two mini-batches (the proximal
    # anchor, a collective), the rollout correction on and the vocabulary projected in chunks.
    policy = PolicyConfig(
        loss=PolicyLoss(clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="token-mean", entropy_coef=0.01,
                        rollout_correction="token_tis", rollout_is_cap=2.0),
        optimizer=Optimizer(lr=1e-2, weight_decay=0.01, warmup_steps=2, grad_clip=0.5),
        compute=PolicyCompute(micro_batch_tokens=24, precision="fp32",
                              logits_chunk_tokens=8),  # the head in chunks, recomputed in the backward under FSDP2
        mini_batches=2)
    return Objective(policy, SamplingConfig(temperature=1.0), KLPenalty(), nll_coef=0.1)


def _batch() -> list[TrainingRow]:
    rng = np.random.default_rng(0)
    samples = []
    for i in range(7):
        n = int(rng.integers(2, 9))
        segment = Segment(prompt_id=f"p{i}", sample_idx=0, window=0, group_id=f"p{i}", group_size=1,
                          prompt_token_ids=int32_array(rng.integers(3, 30, 4)), prior_response_ids=int32_array([]),
                          prior_versions=int32_array([]), new_token_ids=int32_array(rng.integers(3, 30, n)),
                          new_logprobs=float32_array(rng.uniform(-4, -2, n)), new_versions=int32_array([0] * n),
                          finished=True, seed=i, finish_reason=FinishReason.EOS, ground_truth="7", data_source="tiny")
        samples.append(TrainingRow(segment=segment, score=float(i % 2), correct=bool(i % 2),
                                   advantages=float32_array(rng.normal(size=n))))
    return samples


def _stale_batch() -> list[TrainingRow]:
    """Every token masked out of the loss (gone stale) and no positive example: nothing to train."""
    return [msgspec.structs.replace(s, loss_mask=np.zeros(len(s.segment.new_token_ids), np.uint8), correct=False)
            for s in _batch()]


def _rank(parallel=None) -> PolicyRank:
    torch.manual_seed(0)
    return PolicyRank(build_tiny_model(ModelConfig(source="tiny", seed=3), 30), _settings(), parallel=parallel)


def _sharded_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    parallel = join("127.0.0.1", port, world, rank, "gloo", timeout_s=120)
    policy = _rank(parallel)
    metrics = [policy.step(_batch()) for _ in range(2)]
    metrics.append(policy.step(_stale_batch()))
    weights = policy.snapshot()
    state = policy.state()
    if rank == 0:
        with open(os.path.join(out_dir, "sharded.pkl"), "wb") as f:
            pickle.dump({"metrics": metrics, "weights": weights, "state": state,
                         "sharded": type(next(policy.model.parameters())).__name__}, f)
    leave()


def test_a_sharded_step_is_the_one_rank_step_and_saves_the_same_state(tmp_path):
    single = _rank()
    metrics = [single.step(_batch()) for _ in range(2)]
    metrics.append(single.step(_stale_batch()))
    port = free_port()
    store = rendezvous_store("127.0.0.1", port)  # noqa: F841 (held while the ranks meet)
    mp.spawn(_sharded_worker, args=(2, port, str(tmp_path)), nprocs=2)
    with open(tmp_path / "sharded.pkl", "rb") as f:
        sharded = pickle.load(f)

    assert sharded["sharded"] == "DTensor"  # the parameters really were sharded
    weights = single.snapshot()
    assert sharded["weights"].keys() == weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(sharded["weights"][name], tensor, rtol=1e-4, atol=1e-5)
    for key in ("loss", "grad_norm", "clip_fraction", "entropy", "nll_positive", "rollout_kl_k3", "tokens_trained"):
        assert sharded["metrics"][-2][key] == pytest.approx(metrics[-2][key], rel=1e-3, abs=1e-6), key
    # A batch with nothing to train: both of its updates skipped, counted once however many ranks
    # (the learner's update count is Adam's step count: a resumed run checks one against the other).
    for run in (metrics, sharded["metrics"]):
        assert [m["skipped_updates"] for m in run] == [0.0, 0.0, 2.0]
        assert [m["policy_updates"] for m in run] == [2, 2, 2]

    # The checkpoint state is the one-rank format (optimizer state by parameter name, whole):
    # a one-rank learner resumes from a sharded run's state and continues identically.
    s_weights, s_optimizer, s_scheduler = sharded["state"]
    resumed = _rank()
    resumed.load(s_weights, s_optimizer, s_scheduler)
    assert resumed.optimizer_steps() == single.optimizer_steps() == 4
    assert resumed.scheduler.state_dict()["last_epoch"] == single.scheduler.state_dict()["last_epoch"]
    resumed.step(_batch())
    single.step(_batch())
    for name, tensor in single.snapshot().items():
        torch.testing.assert_close(resumed.snapshot()[name], tensor, rtol=1e-4, atol=1e-5)


LORA_MODEL = ModelConfig(source="tiny", seed=3, lora_rank=4, lora_alpha=8)


def _lora_rank(parallel=None) -> PolicyRank:
    from asyncrl.weights import lora

    torch.manual_seed(0)
    lm = build_tiny_model(LORA_MODEL, 30)
    return PolicyRank(lm, _settings(), parallel=parallel, peft_model=lora.wrap(lm, LORA_MODEL), model_config=LORA_MODEL)


def _lora_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    parallel = join("127.0.0.1", port, world, rank, "gloo", timeout_s=120)
    policy = _lora_rank(parallel)
    metrics = [policy.step(_batch()) for _ in range(2)]
    out = {"metrics": metrics, "delivered": policy.delivered(), "snapshot": policy.snapshot(), "state": policy.state(),
           "sharded": type(next(p for p in policy.model.parameters() if p.requires_grad)).__name__}
    if rank == 0:
        with open(os.path.join(out_dir, "lora.pkl"), "wb") as f:
            pickle.dump(out, f)
    leave()


def test_lora_over_two_ranks_is_the_one_rank_lora_step_and_keeps_the_adapter_alone(tmp_path):
    """FSDP2 over LoRA (frozen base weights beside the adapter in each unit): the adapter the
    generators get, the merged weights and the checkpoint state are the one-rank learner's."""
    from asyncrl.weights import lora

    single = _lora_rank()
    metrics = [single.step(_batch()) for _ in range(2)]
    port = free_port()
    store = rendezvous_store("127.0.0.1", port)  # noqa: F841 (held while the ranks meet)
    mp.spawn(_lora_worker, args=(2, port, str(tmp_path)), nprocs=2)
    with open(tmp_path / "lora.pkl", "rb") as f:
        sharded = pickle.load(f)
    assert sharded["sharded"] == "DTensor"
    assert sharded["metrics"][-1]["loss"] == pytest.approx(metrics[-1]["loss"], rel=1e-3, abs=1e-6)
    delivered = single.delivered()
    assert sorted(delivered) == sorted(sharded["delivered"]) and all(n.endswith((".lora_A", ".lora_B")) for n in delivered)
    assert any(float(t.abs().max()) > 0 for n, t in delivered.items() if n.endswith(".lora_B"))  # it trained
    for name, tensor in [*delivered.items(), *single.snapshot().items()]:
        torch.testing.assert_close({**sharded["delivered"], **sharded["snapshot"]}[name], tensor, rtol=1e-4, atol=1e-5)
    weights, optimizer, scheduler = sharded["state"]
    assert weights and all(lora.is_adapter(name) for name in weights)  # no base weight in a checkpoint
    resumed = _lora_rank()
    resumed.load(weights, optimizer, scheduler)
    assert resumed.optimizer_steps() == single.optimizer_steps() == 4
    resumed.step(_batch())
    single.step(_batch())
    for name, tensor in single.delivered().items():
        torch.testing.assert_close(resumed.delivered()[name], tensor, rtol=1e-4, atol=1e-5)
