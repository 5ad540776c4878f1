"""Names from elsewhere: the names verl and TRL users already know (`FOREIGN`: accepted with a
one-line notice of our name, or refused naming our field where the meaning differs; `IGNORED`:
verl's machine settings, not applied, listed in one notice). Our own old names: `asyncrl.config.renames`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

@dataclass(frozen=True)
class Foreign:
    """A name of another framework: the fields of ours it sets (`convert` maps its value to theirs),
    or why it is refused."""

    framework: str
    ours: tuple[str, ...] = ()
    convert: Callable[[Any], tuple] | None = None
    refused: str = ""
    adds: bool = False  # it adds entries to mappings (a reward endpoint of its own)

    def translate(self, value) -> list[tuple[str, Any]]:
        values = self.convert(value) if self.convert else (value,) * len(self.ours)
        return list(zip(self.ours, values))


def _verl(*ours: str, convert=None) -> Foreign:
    return Foreign("verl", ours, convert)


def _trl(*ours: str, convert=None) -> Foreign:
    return Foreign("TRL", ours, convert)


def _refused(framework: str, why: str) -> Foreign:
    return Foreign(framework, refused=why)


def _choice(mapping: dict, name: str) -> Callable[[Any], tuple]:
    def convert(value):
        if str(value) not in mapping:
            raise ValueError(f"{name}={value} has no counterpart here (known: {', '.join(mapping)})")
        return (mapping[str(value)],)
    return convert


_VERL_SCHEDULES = {"constant": "constant", "cosine": "cosine"}
_ADVANTAGES = {"grpo": "grpo", "gae": "gae", "rloo": "rloo", "reinforce_plus_plus": "reinforce_plus_plus",
               "drgrpo": "drgrpo", "dr_grpo": "drgrpo"}
_KL = {"low_var_kl": "low_var_kl", "k3": "low_var_kl", "kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2"}
_ARO = "actor_rollout_ref"
ROLLOUT_ENGINES = {"sglang": "sglang", "vllm": "vllm", "hf": "torch"}  # verl's rollout.name -> our engine preset
FOREIGN: dict[str, Foreign] = {
    # verl (ppo_trainer.yaml)
    f"{_ARO}.rollout.n": _verl("algorithm.group_size"),
    "data.train_files": _verl("task.path"),
    "data.val_files": _verl("task.eval_path"),
    "data.max_response_length": _verl("engine.max_response_tokens"),
    f"{_ARO}.rollout.response_length": _verl("engine.max_response_tokens"),
    "data.train_batch_size": _verl("trainer.prompts_per_step"),
    "data.prompt_key": _verl("task.prompt_key"),
    "data.max_prompt_length": _verl("task.max_prompt_length"),
    # verl's custom reward function becomes a `kind: python` endpoint, scoring every data source.
    "custom_reward_function.path": Foreign("verl", ("reward.endpoints.custom", "reward.routes"),
                                           lambda v: ({"kind": "python", "path": v},
                                                      [{"match": "*", "endpoints": ["custom"]}]), adds=True),
    "custom_reward_function.name": _verl("reward.endpoints.custom.function"),
    "algorithm.adv_estimator": _verl("algorithm.advantage.type", convert=_choice(_ADVANTAGES, "algorithm.adv_estimator")),
    "algorithm.gamma": _verl("algorithm.advantage.gamma"),
    "algorithm.lam": _verl("algorithm.advantage.lam"),
    "algorithm.use_kl_in_reward": _verl("algorithm.advantage.kl_in_reward"),
    "algorithm.kl_ctrl.kl_coef": _verl("algorithm.kl.coef"),
    "algorithm.norm_adv_by_std_in_grpo": _verl("algorithm.advantage.type",
                                               convert=lambda v: ("grpo" if v else "drgrpo",)),
    "algorithm.filter_groups.enable": _verl("algorithm.dynamic_sampling.enabled"),
    "algorithm.filter_groups.metric": _verl("algorithm.dynamic_sampling.metric"),
    "algorithm.filter_groups.max_num_gen_batches": _verl("algorithm.dynamic_sampling.max_refill_rounds"),
    f"{_ARO}.actor.clip_ratio": _verl("policy.loss.clip_low", "policy.loss.clip_high"),
    f"{_ARO}.actor.clip_ratio_low": _verl("policy.loss.clip_low"),
    f"{_ARO}.actor.clip_ratio_high": _verl("policy.loss.clip_high"),
    f"{_ARO}.actor.clip_ratio_c": _verl("policy.loss.dual_clip"),
    f"{_ARO}.actor.loss_agg_mode": _verl("policy.loss.agg"),
    f"{_ARO}.actor.entropy_coeff": _verl("policy.loss.entropy_coef"),
    f"{_ARO}.actor.kl_loss_coef": _verl("algorithm.kl.coef"),
    f"{_ARO}.actor.kl_loss_type": _verl("algorithm.kl.estimator", convert=_choice(_KL, "kl_loss_type")),
    f"{_ARO}.actor.use_kl_loss": _refused("verl", "the KL loss is on whenever algorithm.kl.coef > 0: set that"),
    f"{_ARO}.actor.ppo_epochs": _verl("policy.ppo_epochs"),
    f"{_ARO}.actor.ppo_mini_batch_size": _refused(
        "verl", "it counts prompts per update; asyncrl counts updates per batch: set "
                "policy.mini_batches=train_batch_size/ppo_mini_batch_size"),
    f"{_ARO}.actor.ppo_max_token_len_per_gpu": _verl("policy.compute.micro_batch_tokens"),
    f"{_ARO}.actor.optim.lr": _verl("policy.optimizer.lr"),
    f"{_ARO}.actor.optim.weight_decay": _verl("policy.optimizer.weight_decay"),
    f"{_ARO}.actor.optim.lr_warmup_steps": _verl("policy.optimizer.warmup_steps"),
    f"{_ARO}.actor.optim.lr_scheduler_type": _verl("policy.optimizer.schedule", convert=_choice(
        _VERL_SCHEDULES, "actor_rollout_ref.actor.optim.lr_scheduler_type")),
    f"{_ARO}.actor.optim.warmup_style": _verl("policy.optimizer.schedule", convert=_choice(
        _VERL_SCHEDULES, "actor_rollout_ref.actor.optim.warmup_style")),  # verl's older name
    f"{_ARO}.actor.optim.min_lr_ratio": _verl("policy.optimizer.min_lr_ratio"),
    f"{_ARO}.actor.grad_clip": _verl("policy.optimizer.grad_clip"),
    f"{_ARO}.model.path": _verl("model.source", "model.path", convert=lambda v: ("hf", v)),
    f"{_ARO}.model.enable_gradient_checkpointing": _verl("policy.compute.gradient_checkpointing"),
    f"{_ARO}.model.lora_rank": _verl("model.lora_rank"),
    f"{_ARO}.model.lora_alpha": _verl("model.lora_alpha"),
    f"{_ARO}.model.target_modules": _verl("model.target_modules"),
    f"{_ARO}.actor.freeze_vision_tower": _verl("model.freeze_vision_tower"),
    # verl's R3 replays the rollout's routes; its R2 replays its own old-log-prob forward's, which asyncrl has not.
    f"{_ARO}.actor.router_replay.mode": _verl("model.router_replay", convert=_choice(
        {"R3": "rollout", "disabled": "off"}, "actor_rollout_ref.actor.router_replay.mode")),
    f"{_ARO}.rollout.temperature": _verl("sampling.temperature"),
    f"{_ARO}.rollout.top_p": _verl("sampling.top_p"),
    f"{_ARO}.rollout.top_k": _verl("sampling.top_k", convert=lambda v: (max(int(v), 0),)),  # verl: -1 = off
    f"{_ARO}.rollout.name": _verl("engine.name", convert=_choice(ROLLOUT_ENGINES, "rollout.name")),
    f"{_ARO}.rollout.gpu_memory_utilization": _verl("engine.sglang_mem_fraction"),
    f"{_ARO}.rollout.tensor_model_parallel_size": _verl("engine.sglang_tp_size"),
    "critic.optim.lr": _verl("critic.optimizer.lr"),
    "critic.optim.weight_decay": _verl("critic.optimizer.weight_decay"),
    "critic.optim.lr_scheduler_type": _verl("critic.optimizer.schedule", convert=_choice(
        _VERL_SCHEDULES, "critic.optim.lr_scheduler_type")),
    "critic.optim.min_lr_ratio": _verl("critic.optimizer.min_lr_ratio"),
    "critic.cliprange_value": _verl("critic.loss.clip_low", "critic.loss.clip_high"),
    "critic.grad_clip": _verl("critic.optimizer.grad_clip"),
    "critic.model.path": _verl("critic.init_path"),
    "trainer.total_training_steps": _verl("trainer.total_steps"),
    "trainer.save_freq": _verl("trainer.checkpoint_every", convert=lambda v: (max(int(v), 0),)),  # verl: -1 = never
    "trainer.test_freq": _verl("trainer.eval_every", convert=lambda v: (max(int(v), 0),)),
    "trainer.project_name": _verl("trainer.wandb_project"),
    # verl takes a list, or one name as a string (its older recipes).
    "trainer.logger": _verl("trainer.loggers", convert=lambda v: ([v] if isinstance(v, str) else list(v),)),
    "trainer.default_local_dir": _verl("trainer.run_dir"),
    "trainer.resume_mode": _verl("resume", convert=_choice({"auto": True, "disable": False}, "trainer.resume_mode")),
    "trainer.total_epochs": _refused("verl", "asyncrl counts learner steps: trainer.total_steps"),
    # TRL (GRPOConfig)
    "num_generations": _trl("algorithm.group_size"),
    "max_completion_length": _trl("engine.max_response_tokens"),
    "learning_rate": _trl("policy.optimizer.lr"),
    "weight_decay": _trl("policy.optimizer.weight_decay"),
    "max_grad_norm": _trl("policy.optimizer.grad_clip"),
    "warmup_steps": _trl("policy.optimizer.warmup_steps"),
    # transformers' scheduler names; TRL's default is `linear` (asyncrl's is constant).
    "lr_scheduler_type": _trl("policy.optimizer.schedule", convert=_choice(
        {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"},
        "lr_scheduler_type")),
    "beta": _trl("algorithm.kl.coef"),
    "epsilon": _trl("policy.loss.clip_low", "policy.loss.clip_high"),
    "epsilon_high": _trl("policy.loss.clip_high"),
    "num_iterations": _trl("policy.ppo_epochs"),
    "temperature": _trl("sampling.temperature"),
    "top_p": _trl("sampling.top_p"),
    "top_k": _trl("sampling.top_k"),
    "max_steps": _trl("trainer.total_steps"),
    "seed": _trl("trainer.seed"),
    "save_steps": _trl("trainer.checkpoint_every"),
    "output_dir": _trl("trainer.run_dir"),
    "loss_type": _trl("policy.loss.agg", convert=_choice(
        {"grpo": "seq-mean-token-mean", "dapo": "token-mean", "bnpo": "token-mean",
         "dr_grpo": "seq-mean-token-sum-norm"}, "loss_type")),
    "scale_rewards": _trl("algorithm.advantage.type", convert=_choice(
        {"True": "grpo", "true": "grpo", "group": "grpo", "False": "drgrpo", "false": "drgrpo", "none": "drgrpo"},
        "scale_rewards")),
    "dataset_name": _trl("task.path"),
    "per_device_train_batch_size": _refused("TRL", "asyncrl batches by prompts: trainer.prompts_per_step"),
    "gradient_accumulation_steps": _refused("TRL", "asyncrl accumulates by tokens: policy.compute.micro_batch_tokens"),
}


# Names of verl's that set how verl uses its machines, with no meaning here: not applied, and listed
# together in one notice per run with what asyncrl does instead (`fnmatch` patterns over a dotted
# name or any of its parents: `*.fsdp_config` covers every key below it).
IGNORED: dict[str, str] = {
    "trainer.nnodes": "Ray places each role on the cluster it is given (cluster.ray_address)",
    "trainer.n_gpus_per_node": "Ray places each role: policy.compute.gpus, engine.gpus",
    "trainer.val_before_train": "the held-out set is always evaluated before and after",
    "trainer.log_val_generations": "every trajectory can be kept: trainer.store_trajectories",
    "trainer.critic_warmup": "the critic's warm-up is critic.warmup.steps",
    "trainer.device": "each role's device is its own: engine.device, policy.compute.device",
    "ray_init.*": "Ray is started by asyncrl (cluster.ray_address, cluster.object_store_mb)",
    "data.truncation": "prompts longer than task.max_prompt_length are dropped and counted, never cut",
    "data.filter_overlong_prompts": "prompts longer than task.max_prompt_length are dropped whenever it is set",
    "data.return_raw_chat": "prompts are rendered by the policy's chat template (model.use_chat_template)",
    "data.shuffle": "the prompt source walks a seeded shuffle of the prompts (task.seed)",
    "data.dataloader_num_workers": "the prompt source reads the data once at start-up",
    "data.val_batch_size": "evaluation batches by the engine's rows",
    "*.fsdp_config": "the learner's sharding is policy.compute.ranks (FSDP2)",
    "*.strategy": "the learner's sharding is policy.compute.ranks (FSDP2)",
    "*.ulysses_sequence_parallel_size": "no sequence parallelism: micro-batches are sized in tokens",
    "*.use_dynamic_bsz": "micro-batches are always packed by tokens (policy.compute.micro_batch_tokens)",
    "*.ppo_micro_batch_size_per_gpu": "micro-batches are sized in tokens: policy.compute.micro_batch_tokens",
    "*.ppo_micro_batch_size": "micro-batches are sized in tokens: policy.compute.micro_batch_tokens",
    "*.log_prob_micro_batch_size_per_gpu": "log-probs are computed in the learner's token-sized micro-batches",
    "*.log_prob_micro_batch_size": "log-probs are computed in the learner's token-sized micro-batches",
    "*.log_prob_max_token_len_per_gpu": "log-probs are computed in the learner's token-sized micro-batches",
    "*.forward_micro_batch_size_per_gpu": "the critic's micro-batches are critic.compute.micro_batch_tokens",
    "*.ppo_max_token_len_per_gpu": "the critic's micro-batches are critic.compute.micro_batch_tokens",
    "*.use_remove_padding": "rows are packed without padding where the model allows it",
    "*.use_torch_compile": "the learner runs eager; `asyncrl bench compile` measures compiling",
    "actor_rollout_ref.model.use_shm": "the model is read from its directory once per process",
    "actor_rollout_ref.rollout.mode": "generation is always asynchronous, in windows (engine.window_tokens)",
    "actor_rollout_ref.rollout.enforce_eager": "the engine's own settings: engine.*",
    "actor_rollout_ref.rollout.free_cache_engine": "the engine keeps its KV caches across windows (engine.*)",
    "actor_rollout_ref.rollout.load_format": "weights reach the engine from the learner (policy.weight_transport)",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "the engine batches by rows: engine.*",
    "actor_rollout_ref.rollout.max_num_seqs": "the engine batches by rows: engine.*",
    "actor_rollout_ref.rollout.enable_chunked_prefill": "the engine's own settings: engine.*",
    "actor_rollout_ref.rollout.dtype": "the engine's dtype is engine.dtype",
    "actor_rollout_ref.ref.*": "the reference policy is the initial weights, held by the learner when algorithm.kl.coef > 0",
    "reward_model.reward_manager": "a reward is an endpoint: reward.endpoints, custom_reward_function.path",
    "reward_model.launch_reward_fn_async": "reward functions always run in worker processes beside training",
}


def ignored_reason(key: str) -> str | None:
    """What asyncrl does instead of verl's infrastructure setting `key` (None: not one of them)."""
    from fnmatch import fnmatchcase

    parts = key.lstrip("+~").split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        for pattern, reason in IGNORED.items():
            if fnmatchcase(prefix, pattern):
                return reason
    return None


def ignored_notice(keys: list[str]) -> str:
    """The one notice of a run for every ignored setting, each with what asyncrl does instead."""
    listed = "".join(f"\n  {key}: {ignored_reason(key)}" for key in keys)
    return f"{len(keys)} of verl's settings have no meaning here and are not applied:{listed}"


def foreign_notice(key: str, entry: Foreign, assignments: list[tuple[str, Any]]) -> str:
    written = ", ".join(f"{k}={v}" for k, v in assignments)
    return f"{key} ({entry.framework}'s name) is asyncrl's {written}"


def foreign_table() -> str:
    """The names of other frameworks as a markdown table (docs/config.md holds it; a test keeps the
    two the same)."""
    lines = ["| name | from | in asyncrl |", "|---|---|---|"]
    for key, entry in FOREIGN.items():
        ours = f"refused: {entry.refused}" if entry.refused else ", ".join(f"`{o}`" for o in entry.ours)
        lines.append(f"| `{key}` | {entry.framework} | {ours} |")
    return "\n".join(lines)


def ignored_table() -> str:
    """verl's machinery settings as a markdown table (docs/config.md holds it beside `foreign_table`)."""
    lines = ["| verl's setting | not applied: what asyncrl does instead |", "|---|---|"]
    lines += [f"| `{pattern}` | {reason} |" for pattern, reason in IGNORED.items()]
    return "\n".join(lines)
