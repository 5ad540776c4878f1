"""Policy learner speed: trained tokens/s of the learner's own step (`PolicyRank.step`: log-probs,
the algorithm's loss, backward, clip, AdamW) on a fixed synthetic batch, fp32 against bf16 autocast
on the CPU and, on a machine with CUDA, on the GPU. Paired rounds (each variant once per round).

The batch: `rows` responses of `response` tokens after a `prompt`-token prompt, random token ids
(the speed of a step does not depend on what the tokens say)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np
import torch

from asyncrl.config import compose
from asyncrl.models import load_model, load_tokenizer
from asyncrl.learning.policy import loss_settings
from asyncrl.learning.rank import PolicyRank
from asyncrl.schema import FinishReason, Segment, TrainSample, float32_array, int32_array


def synthetic_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        segment = Segment(prompt_id=f"p{i}", sample_idx=0, turn=0, group_id=f"p{i}", group_size=1,
                          prompt_token_ids=int32_array(rng.integers(3, vocab, prompt)),
                          prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                          new_token_ids=int32_array(rng.integers(3, vocab, response)),
                          new_logprobs=float32_array(rng.uniform(-8.0, -6.0, response)),
                          new_versions=int32_array([0] * response), finished=True, seed=i,
                          finish_reason=FinishReason.EOS, ground_truth="", data_source="bench")
        out.append(TrainSample(segment=segment, score=float(i % 2), correct=bool(i % 2),
                               advantages=float32_array(rng.normal(size=response))))
    return out


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    config = compose((["model=tiny", "task=tiny"] if quick else []) + list(overrides or []))
    torch.set_num_threads(config.policy.threads)
    rows, prompt, response = (8, 16, 16) if quick else (16, 64, 192)
    rounds = 2 if quick else 3
    variants = [("cpu", "fp32"), ("cpu", "bf16")]
    if torch.cuda.is_available():
        variants += [("cuda", "fp32"), ("cuda", "bf16")]
    tokenizer = load_tokenizer(config.model)
    ranks, batch = {}, None
    for device, precision in variants:
        torch.manual_seed(0)
        lm = load_model(config.model, tokenizer).to(device)
        settings = dataclasses.replace(loss_settings(config.algorithm, config.policy, config.engine), precision=precision)
        ranks[(device, precision)] = PolicyRank(lm, settings, config.policy.lr, config.policy.weight_decay)
        batch = batch or synthetic_batch(rows, prompt, response, lm.config.vocab_size)
    seconds: dict[tuple, list[float]] = {v: [] for v in variants}
    for round_ in range(rounds + 1):  # round 0 warms up (allocator, kernels)
        for variant, rank in ranks.items():
            if variant[0] == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            metrics = rank.step(batch)
            if variant[0] == "cuda":
                torch.cuda.synchronize()
            if round_:
                seconds[variant].append(time.perf_counter() - start)
    tokens = rows * response
    base = statistics.median(seconds[("cpu", "fp32")])
    return {f"{device}_{precision}": {
        "seconds_per_step_median": statistics.median(s), "trained_tokens_per_s": tokens / statistics.median(s),
        "speedup_over_cpu_fp32": base / statistics.median(s), "rows": rows, "prompt_tokens": prompt,
        "response_tokens": response, "rounds": rounds, "policy_updates": metrics["policy_updates"],
        "threads": config.policy.threads, "model": config.model.source,
    } for (device, precision), s in seconds.items()}


def report(result: dict) -> str:
    lines = ["| device, precision | s / step | trained tokens/s | vs CPU fp32 |", "|---|---|---|---|"]
    for name, r in result.items():
        lines.append(f"| {name.replace('_', ', ')} | {r['seconds_per_step_median']:.2f} | "
                     f"{r['trained_tokens_per_s']:.0f} | {r['speedup_over_cpu_fp32']:.2f}x |")
    return "\n".join(lines)
