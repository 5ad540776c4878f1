"""Policy learner speed: trained tokens/s of the learner's own step (`PolicyRank.step`: log-probs,
the algorithm's loss, backward, clip, AdamW) on a fixed synthetic batch, fp32 against bf16 autocast
on the CPU and, on a machine with CUDA, on the GPU. Paired rounds (each variant once per round).
Then the optimizer's step alone, torch's default AdamW against the fused one the learners use, and
how close bf16 is to fp32 on the model's own samples (`asyncrl.bench.learner_precision`).

The batch: `rows` responses of `response` tokens after a `prompt`-token prompt, random token ids
(the speed of a step does not depend on what the tokens say)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from asyncrl.bench.learner_precision import precision_gap
from asyncrl.config import compose
from asyncrl.config.fields import replaced
from asyncrl.learning.rank import PolicyRank, policy_objective
from asyncrl.learning.tensors import adamw
from asyncrl.messages.structs import (
                                      FinishReason,
                                      Segment,
                                      TrainingRow,
                                      float32_array,
                                      int32_array,
                                      )
from asyncrl.models.loading import load_model, load_tokenizer


def synthetic_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0) -> list[TrainingRow]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        segment = Segment(prompt_id=f"p{i}", sample_idx=0, window=0, group_id=f"p{i}", group_size=1,
                          prompt_token_ids=int32_array(rng.integers(3, vocab, prompt)),
                          prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                          new_token_ids=int32_array(rng.integers(3, vocab, response)),
                          new_logprobs=float32_array(rng.uniform(-8.0, -6.0, response)),
                          new_versions=int32_array([0] * response), finished=True, seed=i,
                          finish_reason=FinishReason.EOS, ground_truth="", data_source="bench")
        out.append(TrainingRow(segment=segment, score=float(i % 2), correct=bool(i % 2),
                               advantages=float32_array(rng.normal(size=response))))
    return out


def optimizer_seconds(model, rounds: int) -> dict:
    """AdamW's step over `model`'s parameters (random gradients): torch's default implementation
    against the fused one every learner uses (`asyncrl.learning.tensors.adamw`), paired rounds."""
    parameters = list(model.parameters())
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    variants = {"adamw_default": torch.optim.AdamW(parameters, lr=1e-6), "adamw_fused": adamw(parameters, 1e-6, 0.0)}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(rounds + 1):  # round 0 allocates the states
        for name, optimizer in variants.items():
            start = time.perf_counter()
            optimizer.step()
            if round_:
                seconds[name].append(time.perf_counter() - start)
    return {"parameters": sum(p.numel() for p in parameters),
            **{f"{name}_s": statistics.median(s) for name, s in seconds.items()}}


def step_memory(overrides: list[str], rows: int = 16, prompt: int = 64, response: int = 192) -> dict:
    """Peak memory and time of one `PolicyRank.step` (as the learner builds its rank) on the synthetic
    batch, after a warm-up step (Adam's state is allocated there), in this process: call it in a
    fresh one (`fresh_process`). Peak resident memory is `ru_maxrss`; the model load's own peak is
    reported apart, so the difference is what the step adds."""
    import resource

    from asyncrl.learning.rank import build_policy_rank

    config = compose(overrides)
    torch.set_num_threads(config.policy.compute.threads)
    rank, _ = build_policy_rank(config.model, config.algorithm, config.policy, config.engine, config.sampling,
                                config.trainer.seed)
    batch = synthetic_batch(rows, prompt, response, rank.lm.config.vocab_size)
    loaded_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rank.step(batch)
    start = time.perf_counter()
    metrics = rank.step(batch)
    seconds = time.perf_counter() - start
    return {"overrides": overrides, "model_loaded_peak_mb": round(loaded_mb),
            "step_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "step_s": round(seconds, 2), "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "trainable_parameters": sum(p.numel() for p in rank.model.parameters() if p.requires_grad),
            "optimizer_state_mb": round(sum(t.numel() * t.element_size() for s in rank.optimizer.state.values()
                                            for t in s.values() if torch.is_tensor(t)) / 2**20)}


def _step_memory_into(overrides: list[str], sizes: tuple, queue) -> None:
    queue.put(step_memory(overrides, *sizes))


def fresh_process(overrides: list[str], sizes: tuple = (16, 64, 192)) -> dict:
    """`step_memory` in a process of its own (spawned: its peak is its own)."""
    import multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    proc = context.Process(target=_step_memory_into, args=(overrides, sizes, queue))
    proc.start()
    result = queue.get(timeout=3600)
    proc.join(timeout=60)
    return result


def lora_memory(quick: bool, overrides: list[str]) -> dict:
    """The learner's memory and step time with LoRA (rank 32, every linear layer) against full
    fine-tuning, each in a fresh process (--quick: in this one, the tiny model; its peaks are not
    apart)."""
    sizes = (8, 16, 16) if quick else (16, 64, 192)
    base = (["model=tiny", "task=tiny"] if quick else []) + list(overrides)
    measure = (lambda o: step_memory(o, *sizes)) if quick else (lambda o: fresh_process(o, sizes))
    return {name: measure(base + extra) for name, extra in
            (("full", []), ("lora_r32", ["model.lora_rank=32", "model.target_modules=all-linear"]))}


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    config = compose((["model=tiny", "task=tiny"] if quick else []) + list(overrides or []))
    torch.set_num_threads(config.policy.compute.threads)
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
        objective = replaced(policy_objective(config.algorithm, config.policy, config.engine, config.sampling, lm),
                             {"policy.compute.precision": precision})
        ranks[(device, precision)] = PolicyRank(lm, objective)
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
    del ranks  # their models and Adam states: the precision check loads its own
    optimizer = optimizer_seconds(load_model(config.model, tokenizer), rounds)
    torch.manual_seed(0)
    lm = load_model(config.model, tokenizer)
    gap = precision_gap(config, lm, tokenizer,
                        policy_objective(config.algorithm, config.policy, config.engine, config.sampling, lm),
                        *((8, 16) if quick else (16, 64)))
    memory = lora_memory(quick, list(overrides or []))
    return {"precision": gap, "optimizer": optimizer, "lora_memory": memory, **{f"{device}_{precision}": {
        "seconds_per_step_median": statistics.median(s), "trained_tokens_per_s": tokens / statistics.median(s),
        "speedup_over_cpu_fp32": base / statistics.median(s), "rows": rows, "prompt_tokens": prompt,
        "response_tokens": response, "rounds": rounds, "policy_updates": metrics["policy_updates"],
        "threads": config.policy.compute.threads, "model": config.model.source,
    } for (device, precision), s in seconds.items()}}


def report(result: dict) -> str:
    lines = ["| device, precision | s / step | trained tokens/s | vs CPU fp32 |", "|---|---|---|---|"]
    for name, r in result.items():
        if name not in ("precision", "optimizer", "lora_memory"):
            lines.append(f"| {name.replace('_', ', ')} | {r['seconds_per_step_median']:.2f} | "
                         f"{r['trained_tokens_per_s']:.0f} | {r['speedup_over_cpu_fp32']:.2f}x |")
    o = result["optimizer"]
    lines.append(f"AdamW step over {o['parameters'] / 1e6:.1f}M parameters: default {o['adamw_default_s'] * 1e3:.1f} ms, "
                 f"fused (the learners') {o['adamw_fused_s'] * 1e3:.1f} ms")
    for name, m in result.get("lora_memory", {}).items():
        lines.append(f"{name}: {m['trainable_parameters'] / 1e6:.2f}M trained parameters, Adam state "
                     f"{m['optimizer_state_mb']} MB, model loaded {m['model_loaded_peak_mb']} MB, step peak "
                     f"{m['step_peak_mb']} MB, step {m['step_s']:.2f} s")
    g = result["precision"]
    lines += [f"bf16 autocast against fp32 on {g['rows']} sampled responses ({g['trained_tokens']} trained tokens):",
              f"  log-prob gap mean {g['logprob_gap_mean']:.4f}, p99 {g['logprob_gap_p99']:.4f}, max {g['logprob_gap_max']:.4f}",
              f"  gradient cosine {g['grad_cosine_bf16_fp32']:.4f}, relative error {g['grad_relative_error_bf16']:.3f}, "
              f"norm ratio {g['grad_norm_ratio_bf16_over_fp32']:.3f}",
              f"  the batch's own noise (fp32): cosine of its halves' gradients {g['grad_cosine_half_batches_fp32']:.4f}, "
              f"a half against the whole {g['grad_relative_error_half_batch']:.3f}"]
    return "\n".join(lines)
