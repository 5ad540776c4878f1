"""Names from elsewhere: our own old dotted names (`RENAMED`: refused with a "moved to" message, never
a silent alias) and the names verl and TRL users already know (`FOREIGN`: accepted with a one-line
notice of our name, or refused naming our field where the meaning differs). `migrate` moves the
fields of a run's `config.json` written before a rename.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# Our fields that moved (old dotted name -> new one; None: removed, `REMOVED_BECAUSE` says why).
_MOVES: dict[str, tuple[str, tuple[str, ...]]] = {
    # new section: (old section, names); the old name is old section + "." + name
    "algorithm.advantage": ("algorithm", ("gamma", "lam", "length_adaptive_alpha", "lambda_floor", "window_training",
                                          "edge_mask_tokens", "kl_in_reward")),
    "algorithm.kl": ("algorithm", ()),
    "sampling": ("engine", ("temperature", "top_p", "top_k", "first_token_temperature", "first_token_top_k")),
    "policy.optimizer": ("policy", ("lr", "weight_decay", "grad_clip", "warmup_steps")),
    "policy.loss": ("policy", ("clip_low", "clip_high", "dual_clip", "entropy_coef", "proximal_anchor",
                               "behaviour_weight_cap", "rollout_correction", "rollout_is_cap")),
    "policy.compute": ("policy", ("micro_batch_tokens", "device", "precision", "gradient_checkpointing",
                                  "logits_chunk_tokens", "threads", "gpus", "resources", "ranks", "timeout_s")),
    "critic.optimizer": ("critic", ("lr", "weight_decay", "grad_clip")),
    "critic.loss": ("critic", ("lam", "clip_low", "clip_high")),
    "critic.compute": ("critic", ("micro_batch_tokens", "threads", "device", "precision", "gpus", "resources")),
}
RENAMED: dict[str, str | None] = {
    **{f"{old}.{name}": f"{new}.{name}" for new, (old, names) in _MOVES.items() for name in names},
    "algorithm.estimator": "algorithm.advantage.type",
    "algorithm.egae_bootstrap": "algorithm.advantage.bootstrap",
    "algorithm.whiten_advantages": "algorithm.advantage.whiten",
    "algorithm.advantage_clamp": "algorithm.advantage.clamp",
    "algorithm.pairwise_endpoint": "algorithm.advantage.endpoint",
    "algorithm.pairwise_anchor": "algorithm.advantage.anchor",
    "algorithm.filter_metric": "algorithm.dynamic_sampling.metric",
    "algorithm.max_refill_rounds": "algorithm.dynamic_sampling.max_refill_rounds",
    "algorithm.overlong_buffer_tokens": "algorithm.overlong.buffer_tokens",
    "algorithm.overlong_penalty_factor": "algorithm.overlong.penalty_factor",
    "algorithm.kl_coef": "algorithm.kl.coef",
    "algorithm.kl_estimator": "algorithm.kl.estimator",
    "algorithm.importance_clip": "offline.dqo.importance_clip",
    "policy.loss_agg": "policy.loss.agg",
    "policy.loss_norm_tokens": "policy.loss.norm_tokens",
    "critic.warmup_steps": "critic.warmup.steps",
    "critic.warmup_min_steps": "critic.warmup.min_steps",
    "critic.warmup_patience": "critic.warmup.patience",
    "critic.warmup_min_gain": "critic.warmup.min_gain",
    "task.pre_ppo_pool_path": "task.pre_ppo_candidates_path",
    "trainer.record": "trainer.store_trajectories",
    **{f"trainer.record_{name}": f"trainer.store_{name}" for name in ("file_mb", "file_age_s", "keep_mb")},
    # Older moves, to where the fields are now.
    **{f"algorithm.{name}": f"policy.optimizer.{name}" for name in ("lr", "weight_decay", "grad_clip", "warmup_steps")},
    **{f"algorithm.{name}": f"policy.loss.{name}" for name in (
        "clip_low", "clip_high", "dual_clip", "entropy_coef", "proximal_anchor", "behaviour_weight_cap",
        "rollout_correction", "rollout_is_cap")},
    "algorithm.loss_agg": "policy.loss.agg",
    "algorithm.loss_norm_tokens": "policy.loss.norm_tokens",
    "algorithm.micro_batch_tokens": "policy.compute.micro_batch_tokens",
    "algorithm.ppo_epochs": "policy.ppo_epochs",
    "algorithm.mini_batches": "policy.mini_batches",
    **{f"algorithm.{name}": f"task.{name}" for name in (
        "retire_after_groups", "retire_epochs", "retire_unsolved", "retest_every_s")},
    **{f"trainer.{old}": f"policy.compute.{new}" for old, new in (
        ("learner_device", "device"), ("learner_precision", "precision"),
        ("gradient_checkpointing", "gradient_checkpointing"), ("logits_chunk_tokens", "logits_chunk_tokens"),
        ("learner_threads", "threads"), ("learner_gpus", "gpus"), ("learner_resources", "resources"),
        ("learner_ranks", "ranks"), ("learner_timeout_s", "timeout_s"))},
    **{f"trainer.{name}": f"policy.{name}" for name in ("broadcast_bucket_mb", "weight_transport")},
    **{f"trainer.{old}": f"engine.{new}" for old, new in (("generator_gpus", "gpus"),
                                                          ("generator_resources", "resources"))},
    **{f"trainer.{name}": f"cluster.{name}" for name in (
        "num_generators", "placement", "ray_address", "object_store_mb", "mailbox_capacity", "segment_shards",
        "lease_s")},
    "trainer.generator_threads": None,
    "algorithm.scale_advantage_by_std": None,
}
REMOVED_BECAUSE = {
    "trainer.generator_threads": "it was read by nothing; a generator's threads are engine.threads",
    "algorithm.scale_advantage_by_std": "the advantage type says it: algorithm.advantage.type=grpo (scaled by the "
                                        "group's std) or drgrpo (not scaled)",
}


def renamed_message(key: str) -> str | None:
    """The one line for one of our fields that moved or was removed (None for any other key)."""
    if key not in RENAMED:
        return None
    new = RENAMED[key]
    if new is None:
        return f"{key} was removed: {REMOVED_BECAUSE[key]}"
    return f"{key} moved to {new}; write {new}=..."


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


def migrate(data: dict) -> dict:
    """Move the fields of an older config dict (a run's `config.json`) to where they are today."""
    import copy

    data = copy.deepcopy(data)
    algorithm = data.get("algorithm")
    if isinstance(algorithm, dict) and "estimator" in algorithm:
        estimator = {"group": "grpo"}.get(algorithm["estimator"], algorithm["estimator"])
        if algorithm.pop("scale_advantage_by_std", True) is False:
            estimator = "drgrpo"
        algorithm.pop("estimator")
        algorithm["advantage"] = {"type": estimator}
        if isinstance(algorithm.get("dynamic_sampling"), bool):
            algorithm["dynamic_sampling"] = {"enabled": algorithm["dynamic_sampling"]}
        if algorithm.get("name") == "dqo":  # DQO's knobs were the algorithm's
            dqo = {"beta": algorithm.pop("kl_coef", 0.03), "gamma": algorithm.pop("gamma", 1.0),
                   "lam": algorithm.pop("lam", 1.0)}
            data.setdefault("offline", {}).setdefault("dqo", {}).update(dqo)
        # The knobs of another estimator were not used: they go with it.
        if estimator != "pairwise":
            algorithm.pop("pairwise_endpoint", None), algorithm.pop("pairwise_anchor", None)
        if estimator != "gae":
            for name in ("gamma", "lam", "length_adaptive_alpha", "lambda_floor", "window_training", "edge_mask_tokens",
                         "kl_in_reward", "egae_bootstrap", "whiten_advantages", "advantage_clamp"):
                algorithm.pop(name, None)
    for old, new in RENAMED.items():
        value = _pop(data, old)
        if value is not _MISSING and new is not None:
            _put(data, new, value)
    _split_flat_endpoints(data)
    return data


def _split_flat_endpoints(data: dict) -> None:
    """Endpoints were one record with every kind's fields: each keeps only its kind's. A field of
    another kind is dropped where it holds that kind's default; set otherwise, the schema refuses it."""
    from typing import get_args

    import msgspec

    from asyncrl.config.reward import Endpoint

    owned, defaults = {}, {}
    for variant in get_args(Endpoint):
        info = msgspec.inspect.type_info(variant)
        owned[info.tag] = {f.name for f in info.fields} | {"kind"}
        for f in info.fields:
            if f.default is not msgspec.NODEFAULT:
                defaults.setdefault(f.name, []).append(f.default)
    endpoints = (data.get("reward") or {}).get("endpoints")
    for endpoint in (endpoints or {}).values():
        if isinstance(endpoint, dict) and endpoint.get("kind") in owned:
            for name in [n for n in endpoint if n not in owned[endpoint["kind"]]
                         and (endpoint[n] in defaults.get(n, []) or endpoint[n] == "")]:
                endpoint.pop(name)


_MISSING = object()


def _pop(data: dict, path: str):
    *parents, name = path.split(".")
    node = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return node.pop(name, _MISSING) if isinstance(node, dict) else _MISSING


def _put(data: dict, path: str, value) -> None:
    *parents, name = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[name] = value


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
