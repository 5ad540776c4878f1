"""The task: the prompts, their held-out split, and how the prompt source walks them (curriculum,
Pre-PPO selection, retirement of prompts with no learning signal). The prompt source takes this
section whole; evaluation reads the held-out part."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CurriculumStage:
    """One stage of a curriculum: which data sources are served from which learner step."""

    start_step: int = 0
    """The learner step this stage starts at."""
    data_sources: list[str] = field(default_factory=list)
    """Sources served from `start_step` on (empty = all). E.g. code first, then code + math, then all."""


@dataclass
class TaskConfig:
    """The prompts and how they are issued."""

    name: str = "arithmetic"
    """tiny | tiny_seq | arithmetic | file."""
    path: str = ""
    """file: a local jsonl or parquet in verl's layout."""
    eval_path: str = ""
    """file: the held-out prompts (same layout); empty = no held-out evaluation."""
    num_train_prompts: int = 512
    """Built-in tasks: prompts generated for training (and a disjoint held-out set)."""
    num_eval_prompts: int = 64
    """Built-in tasks: held-out prompts."""
    reward: str = "zero_one"
    """zero_one (1/0) | plus_minus (+1/-1, DAPO)."""
    seed: int = 0
    """Built-in tasks: the seed the prompts are generated from."""
    pre_ppo_fraction: float = 0.0
    """Pre-PPO selection: before training, sample a response per candidate prompt with the initial
    policy, score it with `pre_ppo_endpoint`, z-score within each data source and keep the lowest
    fraction per source (paper: 0.1). 0 = off."""
    pre_ppo_pool_path: str = ""
    """Candidates for Pre-PPO (a jsonl/parquet in verl's layout). Empty: the train prompts themselves
    are the candidates. Either way the selection is merged with the train prompts (the paper's
    step 4): selected train prompts appear twice, so the hard ones are drawn twice as often."""
    pre_ppo_endpoint: str = "verifier"
    """Pre-PPO: the reward endpoint that scores the candidates."""
    pre_ppo_samples: int = 4
    """Responses sampled per candidate; its score is their mean (one 0/1 response per prompt ties
    most prompts). Failed rewards are left out of the mean; a candidate with none is not selected."""
    curriculum: list[CurriculumStage] = field(default_factory=list)
    """Stages by learner step, e.g. [{start_step: 0, data_sources: [code]}, {start_step: 50,
    data_sources: [code, math]}, {start_step: 150}]."""
    retire_after_groups: int = 0
    """Prompt retirement: a prompt whose last N groups all had no signal (all correct; with
    `retire_unsolved` also all wrong) is skipped for `retire_epochs` epochs, then tried again
    (counted and shown; `asyncrl train` stops once every prompt is retired). 0 = off."""
    retire_epochs: int = 1
    """How long a retired prompt sits out: until this many datasets' worth of other prompts were issued."""
    retire_unsolved: bool = True
    """Retire prompts whose groups are all wrong too (DAPO learns nothing from them)."""
    retest_every_s: float = 30.0
    """When every prompt is retired (a service that keeps running), the prompt retired longest is
    tried again this often: a swapped reward or a changed policy can bring prompts back."""


@dataclass
class EnvironmentConfig:
    """The environment a task's episodes act in (multi-turn tool use): the generators run each sample
    as an episode, and the environment endpoint answers its tool calls. Empty `name`: single-turn."""

    name: str = ""
    """"" (no environment: one turn) | python (runs the model's code in the sandbox) | lookup (the
    tiny tool task's tool)."""
    tool_format: str = "chatml"
    """How the model writes a call and reads the answer: chatml (`<tool_call>{json}</tool_call>`,
    Hermes/Qwen2.5 style, for ChatML models such as SmolLM2) | tiny (the tiny model's `?`)."""
    max_turns: int = 4
    """Tool calls per episode at most: the turn after the last one ends the episode."""
    timeout_s: float = 30.0
    """A tool call slower than this is retried, then answered with an error observation (never a hang)."""
    retries: int = 2
    """Retries of a failed or timed-out tool call."""
    python_wall_s: float = 5.0
    """python: the wall-clock limit of one run."""
    python_memory_mb: int = 256
    """python: the sandbox's memory."""
    max_observation_chars: int = 512
    """An observation is cut to this many characters (a program that prints megabytes fills no context)."""
    allow_unisolated: bool = False
    """python: where no namespace can be made, run code with rlimits alone instead of refusing."""
    allow_no_cgroup: bool = False
    """python: where no cgroup can be made, run code with memory limited per process only instead of refusing."""
