"""Pre-PPO prompt selection (Data-scaling RLHF, arXiv 2503.22230; ALGORITHMS.md §8): before the
first prompt is issued, sample a response per candidate with the initial policy, score it through
the reward router (the run's timeout and retries), and keep the hardest fraction per data source.

`pre_ppo_selection` is the pure part (scores in, prompt set out); `select_prompts` does the I/O.
"""

from __future__ import annotations

import numpy as np

from asyncrl.algo.selection import select_hardest
from asyncrl.config import EngineConfig, ModelConfig, TaskConfig
from asyncrl.generation import build_engine, complete_async, sampling_params
from asyncrl.rewards.hybrid import RewardRouter
from asyncrl.schema import Reward, RewardRequest
from asyncrl.tasks import Example, encode_prompt, file_examples


def pre_ppo_selection(train: list[Example], train_tokens: list[list[int]], pool: list[Example],
                      pool_tokens: list[list[int]], rewards: list[Reward], fraction: float,
                      pool_joins_train: bool) -> tuple[list[Example], list[list[int]], dict]:
    """The prompt set after selection and a report. The lowest-scoring `fraction` of each data source
    of `pool` is kept (`select_hardest`); a separate pool's selection joins the train prompts, the
    train prompts' own selection replaces them."""
    if len(rewards) != len(pool):
        raise ValueError(f"{len(rewards)} rewards for {len(pool)} candidates")
    scores = np.array([r.score for r in rewards], dtype=np.float64)
    keep = select_hardest(scores, [ex.data_source for ex in pool], fraction)
    chosen, chosen_tokens = [pool[i] for i in keep], [pool_tokens[i] for i in keep]
    if pool_joins_train:
        chosen, chosen_tokens = list(train) + chosen, list(train_tokens) + chosen_tokens
    report = {"candidates": len(pool), "selected": len(keep), "train_prompts": len(chosen),
              "candidate_score_mean": float(scores.mean()) if len(scores) else 0.0,
              "selected_score_mean": float(scores[keep].mean()) if keep else 0.0,
              "failed_rewards": int(sum(r.failed for r in rewards))}
    return chosen, chosen_tokens, report


async def select_prompts(train: list[Example], train_tokens: list[list[int]], model: ModelConfig,
                         engine: EngineConfig, task: TaskConfig, router: RewardRouter,
                         seed: int) -> tuple[list[Example], list[list[int]], dict]:
    """Generate with the initial policy, score through `router`, select (see the module docstring)."""
    embedded, tokenizer = build_engine(model)
    pool = file_examples(task.pre_ppo_pool_path) if task.pre_ppo_pool_path else list(train)
    pool_tokens = [encode_prompt(ex, tokenizer, model.use_chat_template) for ex in pool]
    completions = await complete_async(embedded, tokenizer, pool_tokens, [seed * 7919 + i for i in range(len(pool))],
                                       engine.max_response_tokens, sampling_params(engine),
                                       batch_size=max(1, engine.max_inflight_sequences))
    requests = [RewardRequest(prompt_id=ex.prompt_id, sample_idx=0, response_text=c.text, ground_truth=ex.ground_truth,
                              data_source=ex.data_source, prompt_text=ex.text) for ex, c in zip(pool, completions)]
    rewards = await router.score(requests)
    return pre_ppo_selection(train, train_tokens, pool, pool_tokens, rewards, task.pre_ppo_fraction,
                             pool_joins_train=bool(task.pre_ppo_pool_path))
