"""Held-out evaluation: n samples per prompt scored by the verifiers, pass@1 and pass@k.

`asyncrl eval` runs it on a checkpoint directory (a Hugging Face model dir), the configured model,
or a live policy endpoint (OpenAI-compatible), and writes a table (markdown and JSON).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from asyncrl.config import Config
from asyncrl.engines.base import SamplingParams
from asyncrl.generation import complete
from asyncrl.tasks import Example, encode_prompt, load_examples, score_response


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 − C(n−c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(correct: list[list[bool]], ks: list[int]) -> dict:
    """Per-prompt correctness lists -> mean pass@k for each k (and accuracy = pass@1)."""
    out = {"prompts": len(correct), "samples_per_prompt": len(correct[0]) if correct else 0}
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(len(c), sum(c), k) for c in correct])) if correct else 0.0
    return out


def held_out(config: Config, max_prompts: int | None = None) -> list[Example]:
    t = config.task
    examples = load_examples(t.name, "eval", t.num_eval_prompts, t.seed, t.eval_path or t.path)
    return examples[: max_prompts or len(examples)]


def sample_engine(config: Config, engine, tokenizer, examples: list[Example], n: int, temperature: float) -> list[list[str]]:
    """n responses per held-out prompt from a local engine (temperature 0 = greedy)."""
    params = SamplingParams(greedy=True) if temperature == 0 else SamplingParams(temperature=temperature)
    prompts = [encode_prompt(ex, tokenizer, config.model.use_chat_template) for ex in examples for _ in range(n)]
    seeds = [1_000_003 * i + j for i in range(len(examples)) for j in range(n)]
    texts = [c.text for c in complete(engine, tokenizer, prompts, seeds, config.engine.max_response_tokens, params)]
    return [texts[i * n : (i + 1) * n] for i in range(len(examples))]


def greedy_accuracy(config: Config, engine, tokenizer, max_prompts: int | None = None) -> dict:
    """Greedy pass@1 on the task's held-out prompts (`trainer.eval_samples` of them unless
    `max_prompts`): the before/after/periodic figure of a training run."""
    examples = held_out(config, max_prompts or config.trainer.eval_samples)
    prompts = [encode_prompt(ex, tokenizer, config.model.use_chat_template) for ex in examples]
    completions = complete(engine, tokenizer, prompts, list(range(len(examples))), config.engine.max_response_tokens,
                           SamplingParams(greedy=True))
    correct = score(examples, [[c.text] for c in completions])
    return {"accuracy": sum(c[0] for c in correct) / max(len(examples), 1), "n": len(examples),
            "response_length_mean": float(np.mean([len(c.token_ids) for c in completions])) if completions else 0.0}


def sample_endpoint(url: str, model: str, examples: list[Example], n: int, temperature: float, max_tokens: int) -> tuple[list[list[str]], set]:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    texts, versions = [], set()
    for i, ex in enumerate(examples):
        raw = client.chat.completions.with_raw_response.create(model=model, messages=ex.messages, n=n, seed=i,
                                                               temperature=temperature, max_tokens=max_tokens)
        versions.add(raw.headers.get("x-asyncrl-weight-version"))
        texts.append([c.message.content or "" for c in raw.parse().choices])
    return texts, versions


def score(examples: list[Example], texts: list[list[str]]) -> list[list[bool]]:
    return [[score_response(ex.data_source, t, ex.ground_truth, "zero_one")[1] for t in samples]
            for ex, samples in zip(examples, texts)]


def write_table(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "eval.json"), "w") as f:
        json.dump(result, f, indent=2)
    keys = [k for k in result if k.startswith("pass@")]
    table = "| model | prompts | samples | " + " | ".join(keys) + " |\n|---|---|---|" + "---|" * len(keys) + "\n"
    table += f"| {result['model']} | {result['prompts']} | {result['samples_per_prompt']} | " + \
             " | ".join(f"{result[k]:.3f}" for k in keys) + " |\n"
    with open(os.path.join(out_dir, "eval.md"), "w") as f:
        f.write(table)
    return table
