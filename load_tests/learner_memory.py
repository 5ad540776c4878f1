"""Peak memory and time of one policy learner step, each setting in a fresh process.

    python load_tests/learner_memory.py                                   # embedded model, defaults
    python load_tests/learner_memory.py policy.compute.logits_chunk_tokens=0     # the vocabulary projection unchunked

One `PolicyRank.step` (the learner's own step: log-probs, loss, backward, AdamW) on the synthetic
batch of `asyncrl bench learner` (16 responses of 192 tokens after 64-token prompts, every response
token trained, the positive ones also by the NLL term when `algorithm.nll_coef` is set), after one
warm-up step. Peak resident memory is the child process's `ru_maxrss`; the model load's own peak is
reported apart, so the difference is what the step adds. Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time


def _one(overrides: list[str], queue) -> None:
    import torch

    from asyncrl.bench.learner import synthetic_batch
    from asyncrl.config import compose
    from asyncrl.learning.rank import build_policy_rank

    config = compose(overrides)
    torch.set_num_threads(config.policy.compute.threads)
    # As the learner builds its rank (gradient checkpointing, device, loss settings from the config).
    rank, _ = build_policy_rank(config.model, config.algorithm, config.policy, config.engine, config.sampling,
                                config.trainer.seed)
    batch = synthetic_batch(16, 64, 192, rank.lm.config.vocab_size)
    loaded_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rank.step(batch)  # warm-up: Adam's state is allocated here
    start = time.perf_counter()
    metrics = rank.step(batch)
    seconds = time.perf_counter() - start
    queue.put({"overrides": overrides, "model_loaded_peak_mb": round(loaded_mb),
               "step_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
               "step_s": round(seconds, 2), "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]})


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., policy.compute.logits_chunk_tokens=...)")
    overrides = parser.parse_args(argv).overrides
    context = mp.get_context("spawn")
    queue = context.Queue()
    proc = context.Process(target=_one, args=(overrides, queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join(timeout=60)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
