"""How far the learner's bf16 autocast is from fp32 on one batch of the model's own samples: the
log-probs of the trained tokens and the policy gradient, both through the production step
(`proximal_logprobs`, `policy_step`), set beside the batch's own sampling noise (the gradients of
its two halves, in fp32), which any step already carries.

The batch: responses the model samples from task prompts (the engine in the model's dtype, the
run's sampling settings), one advantage per response drawn from N(0, 1) as group-normalised
outcomes are."""

from __future__ import annotations

import copy

import numpy as np
import torch

from asyncrl.config.fields import replaced
from asyncrl.data.files import load_examples
from asyncrl.data.tasks import encode_prompt
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import sequence_input
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.learning.policy import Objective, policy_step, proximal_logprobs
from asyncrl.learning.scoring import PolicyForward
from asyncrl.learning.tensors import collate
from asyncrl.messages.structs import Segment, TrainingRow, float32_array, int32_array
from asyncrl.models.loading import eos_token_ids


def sampled_batch(config, lm, tokenizer, rows: int, response: int, seed: int = 0) -> list[TrainingRow]:
    engine = TorchEngine(lm, eos_token_ids(lm, tokenizer), tokenizer.pad_token_id or 0)
    examples = load_examples(config.task, "eval", rows)
    prompts = [encode_prompt(ex, tokenizer, config.model.use_chat_template, config.task.chat_template_kwargs) for ex in examples][:rows]
    outs = engine.generate_window_sync([sequence_input(p, seed + i, response) for i, p in enumerate(prompts)],
                                       response, SamplingParams.of(config.sampling))
    advantages = np.random.default_rng(seed).normal(size=len(prompts))
    samples = []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        n = len(out.token_ids)
        segment = Segment(prompt_id=f"p{i}", sample_idx=0, window=0, group_id=f"p{i}", group_size=1,
                          prompt_token_ids=int32_array(prompt), prior_response_ids=int32_array([]),
                          prior_versions=int32_array([]), new_token_ids=out.token_ids, new_logprobs=out.logprobs,
                          new_versions=int32_array([0] * n), finished=True, seed=seed + i,
                          finish_reason=out.finish_reason, ground_truth="", data_source="bench")
        samples.append(TrainingRow(segment=segment, score=0.0, correct=False,
                                   advantages=float32_array(np.full(n, advantages[i]))))
    return samples


def policy_gradient(lm, objective: Objective, samples: list[TrainingRow], pad: int) -> tuple[torch.Tensor, dict]:
    """The gradient `policy_step` computes (no clipping; an optimizer that moves nothing)."""
    model = PolicyForward(copy.deepcopy(lm))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = policy_step(model, optimizer, samples, replaced(objective, {"policy.optimizer.grad_clip": float("inf")}),
                          None, pad)
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return grad, metrics


def precision_gap(config, lm, tokenizer, objective: Objective, rows: int, response: int) -> dict:
    pad = tokenizer.pad_token_id or 0
    samples = sampled_batch(config, lm, tokenizer, rows, response)
    fp32, bf16 = (replaced(objective, {"policy.compute.precision": p, "policy.mini_batches": 1, "policy.ppo_epochs": 1})
                  for p in ("fp32", "bf16"))
    collated = collate(sorted(samples, key=lambda s: len(s.segment.new_token_ids)), pad)
    trained = collated.response_mask > 0
    with torch.no_grad():
        logp = {name: proximal_logprobs(PolicyForward(lm), collated, s.policy, s.sampling)[trained]
                for name, s in (("fp32", fp32), ("bf16", bf16))}
    gap = (logp["bf16"] - logp["fp32"]).abs()
    grads = {name: policy_gradient(lm, s, samples, pad)[0] for name, s in (("fp32", fp32), ("bf16", bf16))}
    halves = [policy_gradient(lm, fp32, part, pad)[0] for part in (samples[: rows // 2], samples[rows // 2:])]
    full = grads["fp32"]
    return {
        "rows": rows, "response_tokens": response, "trained_tokens": int(trained.sum()),
        "logprob_gap_mean": float(gap.mean()), "logprob_gap_p99": float(torch.quantile(gap, 0.99)),
        "logprob_gap_max": float(gap.max()),
        "grad_cosine_bf16_fp32": _cosine(grads["bf16"], full),
        "grad_relative_error_bf16": float((grads["bf16"] - full).norm() / full.norm()),
        "grad_norm_ratio_bf16_over_fp32": float(grads["bf16"].norm() / full.norm()),
        # The noise of the batch itself: two halves of it, each against the other and the whole.
        "grad_cosine_half_batches_fp32": _cosine(halves[0], halves[1]),
        "grad_relative_error_half_batch": float((halves[0] - full).norm() / full.norm()),
    }


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.double(), b.double()) / (a.double().norm() * b.double().norm()))
