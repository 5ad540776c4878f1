"""Can the critic learn the tiny task, and which setting stops it (issue 62, `docs/results.md`,
"Why the critic did not learn")? The value learner's own update (`asyncrl.learning.value.value_step`)
on the tiny model's critic, fed a fixed policy's trajectories of the tiny task, one lever changed
per row; the critic's explained variance measured on 2,000 held-out trajectories of the same policy.

The policy: prompt "d:", two response tokens, reward 1 iff the first is d+1 (mod 10); it answers
right with a probability p_d spread evenly over 0.05..0.95 across the ten prompts, else a uniform
digit. The true values are known: V(before the first token) = p_d + (1 - p_d)/10, V(before the
second) = 1 or 0, so the best explained variance is printed beside (`ceiling`).

    .venv/bin/python load_tests/critic_learning.py                 # every lever, 200 value steps each
    .venv/bin/python load_tests/critic_learning.py --steps 100 --seeds 0 --rows lr_2e-4 today
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.config import ModelConfig, compose  # noqa: E402
from asyncrl.learning.tensors import build_optimizer  # noqa: E402
from asyncrl.learning.value import center_value_head, explained_variance, predict_values, value_step  # noqa: E402
from asyncrl.messages.structs import FinishReason, ScoredTrajectory, Segment, float32_array, int32_array  # noqa: E402
from asyncrl.models.loading import build_tiny_model, value_model_from_policy  # noqa: E402

# One lever per row, against `today` (the tiny task's critic as the presets left it before issue 62).
ROWS = {
    "today": [],
    "lr_2e-4": ["critic.optimizer.lr=2e-4"],
    "lr_5e-4": ["critic.optimizer.lr=5e-4"],
    "lr_2e-3": ["critic.optimizer.lr=2e-3"],
    "lr_2e-4_no_clip": ["critic.optimizer.lr=2e-4", "critic.loss.clip_low=100", "critic.loss.clip_high=100"],
    "lr_2e-4_lam_1": ["critic.optimizer.lr=2e-4", "critic.loss.lam=1.0"],
    "lr_2e-4_zero_head": ["critic.optimizer.lr=2e-4", "critic.head_init=zero"],
    "lr_2e-4_batch_64": ["critic.optimizer.lr=2e-4", "critic.batch_trajectories=64"],
    "lr_5e-4_one_prompt_batches": ["critic.optimizer.lr=5e-4"],
    "lr_5e-4_one_prompt_batches_of_64": ["critic.optimizer.lr=5e-4", "critic.batch_trajectories=64"],
    "lr_5e-4_two_prompt_batches_of_64": ["critic.optimizer.lr=5e-4", "critic.batch_trajectories=64"],
    "lr_5e-4_two_prompt_batches": ["critic.optimizer.lr=5e-4"],
    "lr_1e-3_two_prompt_batches_of_64": ["critic.optimizer.lr=1e-3", "critic.batch_trajectories=64"],
    "lr_2e-3_two_prompt_batches_of_64": ["critic.optimizer.lr=2e-3", "critic.batch_trajectories=64"],
}
# Rows whose batches hold this many prompts (a group of 32 samples arrives whole: 16 or 32 of them
# are one prompt's), not random ones.
PROMPTS_PER_BATCH = {"lr_5e-4_one_prompt_batches": 1, "lr_5e-4_one_prompt_batches_of_64": 1,
                     "lr_5e-4_two_prompt_batches_of_64": 2, "lr_5e-4_two_prompt_batches": 2,
                     "lr_1e-3_two_prompt_batches_of_64": 2, "lr_2e-3_two_prompt_batches_of_64": 2}
BASE = ["model=tiny", "task=tiny", "algorithm=ppo", "critic.optimizer.lr=2e-5", "critic.compute.precision=fp32"]
DIGITS, COLON = list(range(3, 13)), 13  # the tiny vocabulary's "0".."9" and ":"
RIGHT = np.linspace(0.05, 0.95, 10)  # P(right answer | prompt d)


def trajectories(rng: np.random.Generator, n: int, prompts_per_batch: int = 0) -> list[ScoredTrajectory]:
    """`n` trajectories of prompts drawn at random, or of `prompts_per_batch` prompts only (as the
    value learner's batches arrive from the mailbox: a group's samples one after the other)."""
    out = []
    chosen = rng.choice(10, size=prompts_per_batch, replace=False) if prompts_per_batch else None
    for i in range(n):
        d = int(rng.integers(10)) if chosen is None else int(chosen[i * len(chosen) // n])
        right = DIGITS[(d + 1) % 10]
        first = right if rng.random() < RIGHT[d] else DIGITS[int(rng.integers(10))]
        new = int32_array([first, DIGITS[int(rng.integers(10))]])
        segment = Segment(prompt_id=f"p{d}", sample_idx=0, window=0, group_id=f"p{d}",
                          prompt_token_ids=int32_array([DIGITS[d], COLON]), prior_response_ids=int32_array([]),
                          prior_versions=int32_array([]), new_token_ids=new, new_logprobs=float32_array([-1.0, -1.0]),
                          new_versions=int32_array([0, 0]), finished=True, finish_reason=FinishReason.EOS)
        out.append(ScoredTrajectory(segment=segment, score=float(first == right)))
    return out


def held_out_ev(model, held: list[ScoredTrajectory]) -> dict[str, float]:
    """Explained variance of the Monte-Carlo returns (γ=1: the score at both tokens), all tokens and by position."""
    values = predict_values(model, [(t.segment.prompt_token_ids, t.segment.new_token_ids) for t in held])
    predicted = torch.tensor(np.stack(values))
    returns = torch.tensor([[t.score, t.score] for t in held])
    return {"all": explained_variance(returns.flatten(), predicted.flatten()),
            "first": explained_variance(returns[:, 0], predicted[:, 0]),
            "second": explained_variance(returns[:, 1], predicted[:, 1])}


def ceiling(held: list[ScoredTrajectory]) -> float:
    """The explained variance of the true values."""
    true = [[RIGHT[d] + (1 - RIGHT[d]) / 10, t.score] for t in held for d in [int(t.segment.prompt_id[1:])]]
    returns = torch.tensor([[t.score, t.score] for t in held])
    return explained_variance(returns.flatten(), torch.tensor(true, dtype=returns.dtype).flatten())


def one_row(name: str, steps: int, seed: int, held: list[ScoredTrajectory]) -> dict:
    config = compose([*BASE, *ROWS[name]])
    critic = config.critic
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed + 1)
    model = value_model_from_policy(build_tiny_model(ModelConfig(source="tiny", seed=seed), 30))
    optimizer, _ = build_optimizer(model.parameters(), critic.optimizer)
    if critic.head_init == "mean_return":  # as the value learner starts a fresh critic
        center_value_head(model, trajectories(rng, critic.batch_trajectories), config.algorithm.advantage.gamma)
    marks, start, batch_ev = {}, time.perf_counter(), []
    for step in range(1, steps + 1):
        batch = trajectories(rng, critic.batch_trajectories, PROMPTS_PER_BATCH.get(name, 0))
        metrics = value_step(model, optimizer, batch, critic, config.algorithm.advantage.gamma)
        batch_ev.append(metrics["value_explained_variance"])
        if step in (25, 50, 100, 200, 400) or step == steps:
            marks[step] = {k: round(v, 3) for k, v in held_out_ev(model, held).items()}
    return {"row": name, "settings": ROWS[name], "seed": seed, "held_out_ev": marks,
            "batch_ev_last_10_min_max": [round(min(batch_ev[-10:]), 2), round(max(batch_ev[-10:]), 2)],
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    held = trajectories(np.random.default_rng(12345), 2000)
    print(json.dumps({"ceiling_ev": round(ceiling(held), 3), "steps": args.steps, "seeds": args.seeds}))
    for name in args.rows:
        runs = [one_row(name, args.steps, seed, held) for seed in args.seeds]
        for run in runs:
            print(json.dumps(run), flush=True)
        mean = {step: round(float(np.mean([r["held_out_ev"][step]["all"] for r in runs])), 3) for step in runs[0]["held_out_ev"]}
        print(json.dumps({"row": name, "mean_held_out_ev_all": mean}), flush=True)


if __name__ == "__main__":
    main()
