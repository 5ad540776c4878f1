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
import sys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., policy.compute.logits_chunk_tokens=...)")
    overrides = parser.parse_args(argv).overrides
    from asyncrl.bench.learner import fresh_process  # the step, its peak memory: `asyncrl bench learner` measures it

    print(json.dumps(fresh_process(overrides)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
