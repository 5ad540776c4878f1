"""Shared benchmark plumbing: paired timing, machine description, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from typing import Callable

import numpy as np

from asyncrl.messages.structs import FinishReason, Segment, float32_array, int32_array


def cpu_description() -> str:
    """The CPU's model name and the flags that decide our defaults (bf16, AMX), for every timing:
    e.g. "Intel(R) Xeon(R) Processor (amx, avx512_bf16)"."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    shown = [label for flag, label in (("amx_tile", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"),
                                       ("avx2", "avx2")) if flag in flags]
    return f"{name} ({', '.join(shown[:2]) or 'no avx2'})"


def machine() -> dict:
    import torch

    return {
        "cpu": cpu_description(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }


def time_per_call(fn: Callable[[], object], min_seconds: float = 0.2) -> float:
    """Seconds per call, from a loop that runs at least `min_seconds`."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / n


def paired(a: Callable[[], float], b: Callable[[], float], rounds: int) -> dict:
    """Run A, B, A, B... and report medians and the median of per-round ratios b/a."""
    a_times, b_times = [], []
    for _ in range(rounds):
        a_times.append(a())
        b_times.append(b())
    ratios = [y / x for x, y in zip(a_times, b_times)]
    return {
        "a_median": statistics.median(a_times),
        "b_median": statistics.median(b_times),
        "ratio_b_over_a_median": statistics.median(ratios),
        "rounds": rounds,
    }


def write_result(run_dir: str, name: str, result: dict) -> str:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, f"bench_{name}.json")
    with open(path, "w") as f:
        json.dump({"benchmark": name, "machine": machine(), **result}, f, indent=2)
    return path


def make_segment(new_tokens: int, prompt_tokens: int = 256) -> Segment:
    """A finished segment of realistic size (embedded model vocabulary) for the message benchmarks."""
    rng = np.random.default_rng(0)
    return Segment(
        prompt_id="prompt-000123",
        sample_idx=3,
        window=0,
        group_id="prompt-000123",
        prompt_token_ids=int32_array(rng.integers(0, 49152, prompt_tokens)),
        prior_response_ids=int32_array([]),
        prior_versions=int32_array([]),
        new_token_ids=int32_array(rng.integers(0, 49152, new_tokens)),
        new_logprobs=float32_array(-rng.random(new_tokens) * 5),
        new_versions=int32_array(np.full(new_tokens, 17)),
        finished=True,
        finish_reason=FinishReason.EOS,
        data_source="arithmetic",
        ground_truth="42",
        group_size=8,
    )


# Qwen2.5-0.5B's architecture (494M parameters, tied embeddings), random weights.
HALF_B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


# Qwen2.5-1.5B's architecture (1.54B parameters, tied embeddings), random weights.
ONE_HALF_B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
