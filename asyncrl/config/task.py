"""The task: the prompts, their held-out split, and how the prompt source walks them (curriculum,
Pre-PPO selection, retirement of prompts with no learning signal). The prompt source takes this
section whole; evaluation reads the held-out part."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from asyncrl.config.fields import NonNegativeInt, PositiveFloat, PositiveInt, Section, UnitFloat


class CurriculumStage(Section):
    """One stage of a curriculum: which data sources are served from which learner step."""

    start_step: int = 0
    """The learner step this stage starts at."""
    data_sources: list[str] = msgspec.field(default_factory=list)
    """Sources served from `start_step` on (empty = all). E.g. code first, then code + math, then all."""


class TaskConfig(Section):
    """The prompts and how they are issued."""

    name: Literal["tiny", "tiny_seq", "tiny_tool", "arithmetic", "arithmetic_tool", "shapes", "file"] = "arithmetic"
    """tiny | tiny_seq | tiny_tool | arithmetic | arithmetic_tool | shapes (images: the colour of a
    square; a vision-language model, e.g. model=tiny_vl) | file."""
    path: str | list[str] = ""
    """file: the training prompts in verl's layout: a jsonl or parquet file, a glob, a directory
    written by `datasets`' `save_to_disk`, or a list of them (their rows in that order)."""
    eval_path: str | list[str] = ""
    """file: the held-out prompts (same forms); empty = no held-out evaluation."""
    prompt_key: str = "prompt"
    """The column holding the prompt: chat messages, or a plain string (TRL's `prompt`)."""
    answer_key: str = ""
    """The column holding the ground truth; empty = verl's `reward_model.ground_truth`. TRL-style
    data names it `answer` or `solution`. A non-string value (a dict of tests, a list) reaches the
    reward function as it is."""
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    """Options of the chat template the prompts are rendered with, e.g. {enable_thinking: false}
    (Qwen3)."""
    max_prompt_length: NonNegativeInt = 0
    """Prompts longer than this many tokens (chat template applied) are dropped at start-up and the
    count is printed (verl's `filter_overlong_prompts`); 0 = keep every prompt."""
    num_train_prompts: PositiveInt = 512
    """Built-in tasks: prompts generated for training (and a disjoint held-out set)."""
    num_eval_prompts: PositiveInt = 64
    """Built-in tasks: held-out prompts."""
    reward: Literal["zero_one", "plus_minus"] = "zero_one"
    """zero_one (1/0) | plus_minus (+1/-1, DAPO)."""
    seed: int = 0
    """Built-in tasks: the seed the prompts are generated from."""
    pre_ppo_fraction: UnitFloat = 0.0
    """Pre-PPO selection: before training, sample a response per candidate prompt with the initial
    policy, score it with `pre_ppo_endpoint`, z-score within each data source and keep the lowest
    fraction per source (paper: 0.1). 0 = off."""
    pre_ppo_candidates_path: str = ""
    """The candidate prompts Pre-PPO selects from (a jsonl/parquet in verl's layout). Empty: the train
    prompts themselves are the candidates. Either way the selection is merged with the train prompts
    (the paper's step 4): selected train prompts appear twice, so the hard ones are drawn twice as
    often."""
    pre_ppo_endpoint: str = "verifier"
    """Pre-PPO: the reward endpoint that scores the candidates."""
    pre_ppo_samples: PositiveInt = 4
    """Responses sampled per candidate; its score is their mean (one 0/1 response per prompt ties
    most prompts). Failed rewards are left out of the mean; a candidate with none is not selected."""
    curriculum: list[CurriculumStage] = msgspec.field(default_factory=list)
    """Stages by learner step, e.g. [{start_step: 0, data_sources: [code]}, {start_step: 50,
    data_sources: [code, math]}, {start_step: 150}]."""
    retire_after_groups: NonNegativeInt = 0
    """Prompt retirement: a prompt whose last N groups all had no signal (all correct; with
    `retire_unsolved` also all wrong) is skipped for `retire_epochs` epochs, then tried again
    (counted and shown; `asyncrl train` stops once every prompt is retired). 0 = off."""
    retire_epochs: PositiveInt = 1
    """How long a retired prompt sits out: until this many datasets' worth of other prompts were issued."""
    retire_unsolved: bool = True
    """Retire prompts whose groups are all wrong too (DAPO learns nothing from them), for a while:
    they come back as the policy moves (`unsolved_retry_versions`)."""
    unsolved_retry_versions: PositiveInt = 2
    """An unsolved prompt sits out this many policy versions, then is tried again; each retry that
    is all wrong again doubles the wait, up to 4 times this (2, 4, 8, 8, ... versions). When nothing
    else can be issued (the policy no longer moves) it is tried at once."""
    unsolved_max_retries: NonNegativeInt = 64
    """An unsolved prompt all wrong through this many retries is given up for good (counted apart:
    `prompts_given_up`); 0 = never. A run is done only when every prompt is solved or given up.
    Sized for the retries at once when nothing else can be issued (a policy that no longer moves,
    whose hard prompts the tiny task ends at 0.03-0.3%): 64 groups of 32 samples find an answer
    the policy gives 0.1% of the time with probability 0.87, one it gives 0.03% with 0.46."""
    retest_every_s: PositiveFloat = 30.0
    """When every prompt is retired (a service that keeps running), the prompt retired longest is
    tried again this often: a swapped reward or a changed policy can bring prompts back."""


class EnvironmentConfig(Section):
    """The environment a task's episodes act in (multi-turn tool use): the generators run each sample
    as an episode, and the environment endpoint answers its tool calls. Empty `name`: single-turn."""

    class_path: str = ""
    """An environment of your own: `package.module:Class` or `path/to/file.py:Class`, implementing
    the environment protocol (docs/environments.md); instead of `name`."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """class_path: keyword arguments the class is built with."""
    name: Literal["", "python", "lookup"] = ""
    """"" (no environment: one turn) | python (runs the model's code in the sandbox) | lookup (the
    tiny tool task's tool)."""
    tool_format: Literal["chatml", "tiny"] = "chatml"
    """How the model writes a call and reads the answer: chatml (`<tool_call>{json}</tool_call>`,
    Hermes/Qwen2.5 style, for ChatML models such as SmolLM2) | tiny (the tiny model's `?`)."""
    max_turns: PositiveInt = 4
    """Tool calls per episode at most: the turn after the last one ends the episode."""
    timeout_s: PositiveFloat = 30.0
    """A tool call slower than this is retried, then answered with an error observation (never a hang)."""
    retries: NonNegativeInt = 2
    """Retries of a failed or timed-out tool call."""
    python_wall_s: PositiveFloat = 5.0
    """python: the wall-clock limit of one run."""
    python_memory_mb: Annotated[int, msgspec.Meta(ge=16)] = 256
    """python: the sandbox's memory."""
    max_observation_chars: PositiveInt = 512
    """An observation is cut to this many characters (a program that prints megabytes fills no context)."""
    allow_unisolated: bool = False
    """python: where no namespace can be made, run code with rlimits alone instead of refusing."""
    allow_no_cgroup: bool = False
    """python: where no cgroup can be made, run code with memory limited per process only instead of refusing."""

    @property
    def enabled(self) -> bool:
        """Episodes act in an environment (a built-in by `name`, or a class of the user's)."""
        return bool(self.name or self.class_path)
