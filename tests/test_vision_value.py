"""The value learner on a vision-language model (issue 58, item 3): the critic (the tiny Qwen2-VL's
trunk with a scalar head) takes the images of its rows' prompts as the policy learner does: its
values equal transformers' own forward with the pixels row by row, an image changes them, the
tower runs once per prompt per micro-batch and stays frozen by default, and PPO runs through the
real pipeline on `task=shapes`."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from actors.value_learner import build_value_learner
from asyncrl.config import compose
from asyncrl.data.files import load_examples
from asyncrl.data.tasks import encode_prompt
from asyncrl.learning.value import predict_values, value_step
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.messages.structs import FinishReason, ScoredTrajectory, Segment, float32_array, int32_array
from asyncrl.models.loading import load_policy, value_model_from_policy
from asyncrl.models.vision import image_prep, image_token_ids, without_image_tokens
from asyncrl.storage.images import load_processed

VL_PPO = ["model=tiny_vl", "task=shapes", "algorithm=ppo", "critic.compute.precision=fp32"]
RESPONSES = ([5, 7, 1], [9, 1], [6, 6, 6, 1])  # of different lengths: the rows are padded


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Images kept under this test's directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def _prompts(config, n: int) -> list[tuple[np.ndarray, tuple[str, ...]]]:
    """`n` shapes prompts: their ids (image tokens included) and their processed images by reference."""
    lm, tokenizer = load_policy(config.model)
    prep = image_prep(config.model, tokenizer, lm)
    return [(np.asarray(encode_prompt(ex, tokenizer, False, images=prep)), prep.processed(ex.images))
            for ex in load_examples(config.task, "train", n)]


def _trajectory(ids, refs, tokens, score: float) -> ScoredTrajectory:
    segment = Segment(prompt_id="p", sample_idx=0, window=0, group_id="p", prompt_token_ids=int32_array(ids),
                      prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                      new_token_ids=int32_array(tokens), new_logprobs=float32_array([-1.0] * len(tokens)),
                      new_versions=int32_array([0] * len(tokens)), finished=True, finish_reason=FinishReason.EOS,
                      images=refs)
    return ScoredTrajectory(segment=segment, score=score)


def _transformers_values(value_model, ids, refs, tokens) -> np.ndarray:
    """V(s_t) of one row from transformers' own Qwen2-VL trunk (pixels through its own vision tower,
    its own rope index) and the critic's head: the states before each new token and after the last."""
    row = torch.tensor(np.concatenate([ids, tokens]).astype(np.int64))[None]
    pixels = torch.cat([load_processed(r)[0] for r in refs])
    grid = torch.stack([load_processed(r)[1] for r in refs])
    with torch.no_grad():
        hidden = value_model.backbone(input_ids=row, attention_mask=torch.ones_like(row), pixel_values=pixels,
                                      image_grid_thw=grid,
                                      mm_token_type_ids=(row == value_model.backbone.config.image_token_id).int())
        values = value_model.head(hidden.last_hidden_state[0]).squeeze(-1)
    return values[len(ids) - 1:].numpy()


def _transformers_logprobs(lm, ids, refs, tokens) -> np.ndarray:
    """log π(token | prefix) of one row from transformers' own forward with the pixels, over the
    distribution without image tokens the engine samples from."""
    row = torch.tensor(np.concatenate([ids, tokens]).astype(np.int64))[None]
    with torch.no_grad():
        logits = lm(input_ids=row, attention_mask=torch.ones_like(row),
                    pixel_values=torch.cat([load_processed(r)[0] for r in refs]),
                    image_grid_thw=torch.stack([load_processed(r)[1] for r in refs]),
                    mm_token_type_ids=(row == lm.config.image_token_id).int()).logits[0].float()
    logp = torch.log_softmax(without_image_tokens(logits, image_token_ids(lm)), -1)[len(ids) - 1:-1]
    return logp.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None]).squeeze(-1).numpy()


def _critic(config):
    """A critic from the initial policy with a random head (a zero head values everything 0)."""
    value_model = value_model_from_policy(load_policy(config.model)[0]).eval()
    torch.manual_seed(1)
    torch.nn.init.normal_(value_model.head.weight, std=0.5)
    return value_model


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])  # Qwen3-VL: deepstack features in the trunk
def test_critic_values_with_images_equal_transformers_forward_row_by_row(store, family):
    config = compose([*VL_PPO, f"model.vision_family={family}"])
    prompts = _prompts(config, 3)
    value_model = _critic(config)
    rows = [(ids, np.asarray(tokens)) for (ids, _), tokens in zip(prompts, RESPONSES)]
    images = [refs for _, refs in prompts]
    got = predict_values(value_model, rows, with_next=True, images=images)
    for (ids, refs), tokens, values in zip(prompts, RESPONSES, got):
        np.testing.assert_allclose(values, _transformers_values(value_model, ids, refs, tokens), atol=1e-5)
    # Another image under the same tokens: other values (the images are really read).
    swapped = predict_values(value_model, rows[:1], with_next=True, images=[images[1]])
    assert prompts[0][1] != prompts[1][1] and np.abs(swapped[0] - got[0]).max() > 1e-4
    # Without the images the image tokens are plain embeddings: other values again.
    assert np.abs(predict_values(value_model, rows[:1], with_next=True)[0] - got[0]).max() > 1e-4


def test_the_assemblers_values_and_kl_rewards_read_the_images(store):
    # The serving copy answers the assembler's value requests; with the KL in the reward, the
    # reference policy scores the same rows with their images as the policy learner does.
    config = compose([*VL_PPO, "algorithm.advantage.kl_in_reward=true", "algorithm.kl.coef=0.01"])
    prompts = _prompts(config, 2)
    learner = build_value_learner(config.model, config.critic, config.algorithm, config.sampling, 0,
                                  InProcessMailbox(10))
    torch.nn.init.normal_(learner.serving.head.weight, std=0.5)
    rows = [(ids, np.asarray(tokens)) for (ids, _), tokens in zip(prompts, RESPONSES)]
    images = [refs for _, refs in prompts]
    values, version = asyncio.run(learner.values(rows, images))
    assert version == 0
    for (ids, refs), tokens, v in zip(prompts, RESPONSES, values):
        np.testing.assert_allclose(v, _transformers_values(learner.serving, ids, refs, tokens), atol=1e-5)
    reference = asyncio.run(learner.reference_logprobs(rows, images))
    for (ids, refs), tokens, logp in zip(prompts, RESPONSES, reference):
        np.testing.assert_allclose(logp, _transformers_logprobs(learner.reference, ids, refs, tokens), atol=1e-5)


def _count_tower_images(value_model) -> list[int]:
    """Images the vision tower sees at each of its calls (a forward hook on it)."""
    seen: list[int] = []
    value_model.backbone.visual.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(len(kwargs["grid_thw"])), with_kwargs=True)
    return seen


@pytest.mark.parametrize("order, micro_batches, images_seen", [
    ("AAABBB", 1, [2]),  # one micro-batch: each of the two prompts' images once, in one call
    ("AAABBB", 2, [1, 1]),  # a prompt per micro-batch
    ("ABABAB", 2, [2, 2]),  # both prompts in each micro-batch
])
def test_the_vision_tower_runs_once_per_prompt_per_micro_batch(store, order, micro_batches, images_seen):
    prompts = dict(zip("AB", _prompts(compose(VL_PPO), 2)))
    length = len(prompts["A"][0]) + 2  # every row alike: the sort by length keeps their order
    config = compose([*VL_PPO, f"critic.compute.micro_batch_tokens={length * 6 // micro_batches}"])
    learner = build_value_learner(config.model, config.critic, config.algorithm, config.sampling, 0,
                                  InProcessMailbox(10))
    seen = _count_tower_images(learner.model)
    batch = [_trajectory(*prompts[key], [5, 1], float(key == "A")) for key in order]
    metrics = value_step(learner.model, learner.optimizer, batch, learner.critic, 1.0)
    assert seen == images_seen and metrics["value_vision_s"] > 0
    seen.clear()  # the assembler's values: the same chunks over the serving copy's tower
    predict_values(learner.model, [(t.segment.prompt_token_ids, t.segment.new_token_ids) for t in batch],
                   max_tokens=config.critic.compute.micro_batch_tokens, images=[t.segment.images for t in batch])
    assert sum(seen) == sum(images_seen)


@pytest.mark.parametrize("frozen", [True, False])
def test_the_critics_vision_tower_is_frozen_by_default_and_trained_when_asked(store, frozen):
    config = compose([*VL_PPO, f"model.freeze_vision_tower={str(frozen).lower()}"])
    prompts = _prompts(config, 2)
    learner = build_value_learner(config.model, config.critic, config.algorithm, config.sampling, 0,
                                  InProcessMailbox(10))
    torch.nn.init.normal_(learner.model.head.weight, std=0.5)  # a zero head passes no gradient to the trunk
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    value_step(learner.model, learner.optimizer, [_trajectory(ids, refs, [5, 1], s)
                                                  for (ids, refs), s in zip(prompts, (1.0, 0.0))], learner.critic, 1.0)
    moved = {n for n, p in learner.model.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("backbone.language_model.") for n in moved)
    assert any(n.startswith("backbone.visual.") for n in moved) != frozen


@pytest.mark.slow  # 30-65 s each on two cores
@pytest.mark.parametrize("algorithm", ["ppo", "tppo"])  # whole responses; windows (EGAE)
def test_value_based_algorithms_train_a_vision_language_model_through_the_pipeline(ray_session, store, algorithm):
    from asyncrl.driver import train

    config = compose(["model=tiny_vl", "task=shapes", f"algorithm={algorithm}", "trainer.total_steps=3",
                      f"trainer.run_dir={store}", "trainer.wandb_mode=disabled"])
    summary = train(config, progress=False, eval_prompts=4)
    records = [json.loads(line) for line in open(store / "metrics.jsonl")]
    assert len(records) == 3
    assert summary["final_status"]["ledger"]["problems"] == []
    # The critic trained on the image trajectories, its tower on their images.
    assert "value_explained_variance" in records[-1], sorted(records[-1])
    assert summary["final_status"]["value_learner"]["value_steps"] > 0 and records[-1]["value_vision_s"] > 0
    assert all(r["vision_s"] > 0 for r in records)  # the policy learner's tower too
