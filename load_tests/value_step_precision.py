"""Time and peak memory of the value learner's own step in fp32 and bf16, side by side, each in a
fresh process.

    python load_tests/value_step_precision.py                    # embedded model, VAPO's critic
    python load_tests/value_step_precision.py --steps 5 model=tiny

`value_step` (the function the value learner calls) on 16 finished trajectories of 100 prompt and
60 response tokens, for the critic `build_value_learner` builds with `critic.compute.precision` set to
each value, one torch thread. Prints one line per step and one JSON line per precision.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import time


def _one(precision: str, overrides: list[str], steps: int, queue) -> None:
    import numpy as np
    import torch

    from actors.value_learner import build_value_learner
    from asyncrl.config import compose
    from asyncrl.learning.value import value_step
    from asyncrl.messages.mailbox import InProcessMailbox
    from asyncrl.messages.structs import FinishReason, ScoredTrajectory, Segment, float32_array, int32_array

    torch.set_num_threads(1)
    config = compose(["algorithm=vapo", *overrides, f"critic.compute.precision={precision}"])
    learner = build_value_learner(config.model, config.critic, config.algorithm, config.sampling, 0, InProcessMailbox(2))
    vocab = learner.model.backbone.config.vocab_size
    rng = np.random.default_rng(0)
    batch = [ScoredTrajectory(segment=Segment(
        prompt_id=f"p{i}", sample_idx=0, window=0, group_id=f"p{i}", prompt_token_ids=int32_array(rng.integers(10, vocab, 100)),
        prior_response_ids=int32_array([]), prior_versions=int32_array([]),
        new_token_ids=int32_array(rng.integers(10, vocab, 60)), new_logprobs=float32_array([-1.0] * 60),
        new_versions=int32_array([0] * 60), finished=True, finish_reason=FinishReason.EOS), score=float(i % 2))
        for i in range(16)]
    loaded_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds, losses = [], []
    for k in range(steps):
        start = time.perf_counter()
        metrics = value_step(learner.model, learner.optimizer, batch, learner.critic, learner.gamma)
        seconds.append(time.perf_counter() - start)
        losses.append(metrics["value_loss"])
        print(f"{precision} step {k}: {seconds[-1]:.2f} s, loss {losses[-1]:.4f}", flush=True)
    queue.put({"precision": learner.critic.compute.precision, "step_s": seconds, "value_loss": losses,
               "loaded_peak_mb": round(loaded_mb), "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    for precision in ("fp32", "bf16"):
        queue = context.Queue()
        process = context.Process(target=_one, args=(precision, args.overrides, args.steps, queue))
        process.start()
        result = queue.get()
        process.join()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
