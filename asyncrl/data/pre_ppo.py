"""Pre-PPO prompt selection (Data-scaling RLHF, arXiv 2503.22230; docs/algorithms.md §8): before the
first prompt is issued, sample `pre_ppo_samples` responses per candidate with the initial policy,
score them through the reward router (the run's timeout and retries), and keep the hardest
fraction per data source; the selection is merged with the train prompts (the paper's step 4).

`pre_ppo_selection` is the pure part (scores in, prompt set out); `select_prompts` does the I/O.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncrl.algo.selection import select_hardest
from asyncrl.config import EngineConfig, ModelConfig, SamplingConfig, TaskConfig
from asyncrl.data.files import file_examples
from asyncrl.data.tasks import Example, encode_prompt
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import build_engine, complete_async
from asyncrl.messages.structs import Reward, RewardRequest
from asyncrl.rewards.hybrid import RewardRouter

# Suffix of a selected train prompt's second copy: prompt ids stay unique in the prompt source.
REPEAT_SUFFIX = "#hard"


def candidate_scores(rewards: list[list[Reward]]) -> tuple[np.ndarray, np.ndarray]:
    """Each candidate's mean score over its responses whose reward did not fail, and whether it
    has any such response (a failed reward's 0.0 is not a score)."""
    scores, valid = np.zeros(len(rewards)), np.zeros(len(rewards), dtype=bool)
    for i, group in enumerate(rewards):
        good = [r.score for r in group if not r.failed]
        if good:
            scores[i], valid[i] = float(np.mean(good)), True
    return scores, valid


def pre_ppo_selection(train: list[Example], train_tokens: list[list[int]], candidates: list[Example],
                      candidate_tokens: list[list[int]], rewards: list[list[Reward]], fraction: float,
                      seed: int = 0) -> tuple[list[Example], list[list[int]], dict]:
    """The prompt set after selection and a report. `rewards[i]` holds candidate i's responses'
    rewards. The lowest-scoring `fraction` of each data source of `candidates` is selected
    (`select_hardest`) and merged with the train prompts: a candidate that is itself a train prompt
    is added again under the id `<id>#hard`, so it is drawn twice as often."""
    if len(rewards) != len(candidates):
        raise ValueError(f"{len(rewards)} reward lists for {len(candidates)} candidates")
    scores, valid = candidate_scores(rewards)
    keep = select_hardest(scores, [ex.data_source for ex in candidates], fraction, valid, seed)
    train_ids = {ex.prompt_id for ex in train}
    chosen, chosen_tokens = list(train), list(train_tokens)
    for i in keep:
        ex = candidates[i]
        if ex.prompt_id in train_ids:
            ex = dataclasses.replace(ex, prompt_id=ex.prompt_id + REPEAT_SUFFIX)
        chosen.append(ex)
        chosen_tokens.append(candidate_tokens[i])
    failed = sum(r.failed for group in rewards for r in group)
    report = {"candidates": len(candidates), "selected": len(keep), "train_prompts": len(chosen),
              "responses_per_candidate": max((len(g) for g in rewards), default=0),
              "candidate_score_mean": float(scores[valid].mean()) if valid.any() else 0.0,
              "selected_score_mean": float(scores[keep].mean()) if keep else 0.0,
              "failed_rewards": int(failed), "candidates_without_score": int((~valid).sum())}
    return chosen, chosen_tokens, report


async def select_prompts(train: list[Example], train_tokens: list[list[int]], model: ModelConfig,
                         engine: EngineConfig, sampling: SamplingConfig, task: TaskConfig, router: RewardRouter,
                         seed: int) -> tuple[list[Example], list[list[int]], dict]:
    """Generate with the initial policy, score through `router`, select (see the module docstring)."""
    embedded, tokenizer = build_engine(model)
    candidates = file_examples(task.pre_ppo_candidates_path) if task.pre_ppo_candidates_path else list(train)
    candidate_tokens = [encode_prompt(ex, tokenizer, model.use_chat_template, task.chat_template_kwargs)
                        for ex in candidates]
    k = task.pre_ppo_samples
    completions = await complete_async(embedded, tokenizer, [t for t in candidate_tokens for _ in range(k)],
                                       [seed * 7919 + i for i in range(len(candidates) * k)],
                                       engine.max_response_tokens, SamplingParams.of(sampling),
                                       batch_size=max(1, engine.max_inflight_sequences))
    requests = [RewardRequest(prompt_id=ex.prompt_id, sample_idx=j, response_text=completions[i * k + j].text,
                              ground_truth=ex.ground_truth, data_source=ex.data_source, prompt_text=ex.text)
                for i, ex in enumerate(candidates) for j in range(k)]
    rewards = await router.score(requests)
    per_candidate = [rewards[i * k:(i + 1) * k] for i in range(len(candidates))]
    return pre_ppo_selection(train, train_tokens, candidates, candidate_tokens, per_candidate, task.pre_ppo_fraction,
                             seed)
