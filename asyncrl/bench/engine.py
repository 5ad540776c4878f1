"""Embedded engine speed: tokens/s of `TorchEngine` against transformers' own `generate` on the
same model, prompts and length, paired rounds (engine, generate, engine, ...). On `engine.device`
(`engine.device=cuda` on a GPU: batches up to 256). With `engine=sglang_cpu` (or `engine=sglang`),
SGLang beside the embedded engine instead (`asyncrl.bench.sglang_bench`)."""

from __future__ import annotations

import time

import numpy as np
import torch

from asyncrl.config import compose
from asyncrl.engines.base import SamplingParams
from asyncrl.generation import build_engine, sequence_input
from asyncrl.tasks import encode_prompt, load_examples


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    config = compose(overrides or [])
    if config.engine.name == "sglang":  # SGLang beside the embedded engine (.venv-sglang)
        from asyncrl.bench.sglang_bench import engine_speed

        return engine_speed(config, quick)
    torch.set_num_threads(config.engine.threads)
    device = config.engine.device
    engine, tokenizer = build_engine(config.model, device=device)
    new_tokens = 16 if quick else 64
    batches = (1, 4) if quick else (1, 16, 64, 256) if device == "cuda" else (1, 16, 64)
    rounds = 1 if quick else 3
    examples = load_examples(config.task.name, "eval", max(batches), config.task.seed, config.task.eval_path)
    prompts = [encode_prompt(ex, tokenizer, config.model.use_chat_template) for ex in examples]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    results = {}
    for batch in batches:
        chosen = [prompts[i % len(prompts)] for i in range(batch)]
        # A budget nobody can stop early on: both sides generate exactly `new_tokens` per row.
        no_eos_engine_ids = engine.eos_token_ids
        engine.eos_token_ids = torch.tensor([-1])
        sequences = [sequence_input(p, i, new_tokens) for i, p in enumerate(chosen)]
        width = max(len(p) for p in chosen)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chosen], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chosen], device=device)
        ours, theirs = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            engine.generate_window_sync(sequences, new_tokens, SamplingParams(temperature=1.0))
            ours.append(batch * new_tokens / (time.perf_counter() - start))
            start = time.perf_counter()
            with torch.inference_mode():
                engine.model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      pad_token_id=pad)
            theirs.append(batch * new_tokens / (time.perf_counter() - start))
        engine.eos_token_ids = no_eos_engine_ids
        results[f"batch_{batch}"] = {
            "asyncrl_tokens_per_s": float(np.median(ours)),
            "hf_generate_tokens_per_s": float(np.median(theirs)),
            "ratio_asyncrl_over_hf": float(np.median([a / b for a, b in zip(ours, theirs)])),
            "new_tokens": new_tokens, "rounds": rounds, "threads": config.engine.threads, "device": device,
        }
    return results


def report(results: dict) -> str:
    if "sglang_tokens_per_s" in next(iter(results.values())):
        from asyncrl.bench.sglang_bench import engine_report

        return engine_report(results)
    lines = ["| batch | asyncrl engine tok/s | HF generate tok/s | asyncrl / HF |", "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name.removeprefix('batch_')} | {r['asyncrl_tokens_per_s']:.1f} | "
                     f"{r['hf_generate_tokens_per_s']:.1f} | {r['ratio_asyncrl_over_hf']:.2f}x |")
    return "\n".join(lines)
