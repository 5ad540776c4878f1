"""Checks of a composed config: numeric ranges and the cross-field rules the schema alone cannot
express. Every rule is one line of a message naming the field; a bad setting is refused at
start-up, never silently ignored."""

from __future__ import annotations

from asyncrl.config.reward import RouteConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field."""


# Ranges of numeric fields: ">= 1", "> 0", "[0, 1]" or "(0, 1]"; `*` matches any entry of a
# mapping; a null (where the field allows it) is always in range.
RANGES = {
    "model.hidden_size": ">= 1", "model.num_layers": ">= 1", "model.num_heads": ">= 1", "model.max_positions": ">= 1",
    "engine.window_tokens": ">= 1", "engine.max_response_tokens": ">= 1", "engine.max_windows": ">= 0",
    "engine.max_inflight_sequences": ">= 1", "engine.temperature": "> 0", "engine.top_p": "(0, 1]",
    "engine.top_k": ">= 0", "engine.first_token_temperature": "> 0", "engine.first_token_top_k": ">= 0",
    "engine.threads": ">= 1", "engine.long_tail_fraction": "[0, 1]", "engine.long_tail_tokens": ">= 0",
    "engine.sglang_mem_fraction": "(0, 1)", "engine.sglang_tp_size": ">= 1", "engine.gpus": ">= 0",
    "engine.sglang_max_total_tokens": ">= 0", "engine.sglang_max_running_requests": ">= 0",
    "engine.sglang_chunked_prefill_tokens": ">= 0",
    "algorithm.group_size": ">= 1", "algorithm.kl_coef": ">= 0", "algorithm.overlong_buffer_tokens": ">= 0",
    "algorithm.overlong_penalty_factor": ">= 0", "algorithm.max_staleness_versions": ">= 0",
    "algorithm.gamma": "(0, 1]", "algorithm.lam": "[0, 1]", "algorithm.length_adaptive_alpha": ">= 0",
    "algorithm.edge_mask_tokens": ">= 0", "algorithm.advantage_clamp": ">= 0", "algorithm.nll_coef": ">= 0",
    "algorithm.max_refill_rounds": ">= 0", "algorithm.importance_clip": "> 0",
    "policy.lr": "> 0", "policy.weight_decay": ">= 0", "policy.grad_clip": "> 0", "policy.warmup_steps": ">= 0",
    "policy.clip_low": "[0, 1)", "policy.clip_high": ">= 0", "policy.entropy_coef": ">= 0",
    "policy.micro_batch_tokens": ">= 1", "policy.ppo_epochs": ">= 1", "policy.mini_batches": ">= 1",
    "policy.behaviour_weight_cap": ">= 1", "policy.loss_norm_tokens": ">= 0", "policy.rollout_is_cap": ">= 1",
    "policy.threads": ">= 1", "policy.gpus": ">= 0", "policy.ranks": ">= 1", "policy.timeout_s": "> 0",
    "policy.logits_chunk_tokens": ">= 0", "policy.broadcast_bucket_mb": ">= 1",
    "critic.lr": "> 0", "critic.weight_decay": ">= 0", "critic.grad_clip": "> 0", "critic.lam": "[0, 1]",
    "critic.clip_low": ">= 0", "critic.clip_high": ">= 0", "critic.batch_trajectories": ">= 1",
    "critic.warmup_steps": ">= 0", "critic.warmup_min_steps": ">= 0", "critic.warmup_patience": ">= 1",
    "critic.warmup_min_gain": ">= 0", "critic.micro_batch_tokens": ">= 1", "critic.threads": ">= 1", "critic.gpus": ">= 0",
    "reward.timeout_s": "> 0", "reward.retries": ">= 0", "reward.endpoints.*.code_wall_s": "> 0",
    "reward.endpoints.*.code_memory_mb": ">= 16", "reward.endpoints.*.math_timeout_s": "> 0",
    "reward.endpoints.*.fault_delay_s": ">= 0", "reward.routes.*.dense_lambda_fail": ">= 0",
    "reward.routes.*.dense_lambda_pass": ">= 0",
    "task.num_train_prompts": ">= 1", "task.num_eval_prompts": ">= 1", "task.pre_ppo_fraction": "[0, 1]",
    "task.pre_ppo_samples": ">= 1", "task.retire_after_groups": ">= 0", "task.retire_epochs": ">= 1",
    "task.retest_every_s": "> 0", "environment.max_turns": ">= 1", "environment.timeout_s": "> 0",
    "environment.retries": ">= 0", "environment.python_wall_s": "> 0", "environment.python_memory_mb": ">= 16",
    "environment.max_observation_chars": ">= 1",
    "trainer.total_steps": ">= 1", "trainer.prompts_per_step": ">= 1", "trainer.eval_every": ">= 0",
    "trainer.checkpoint_every": ">= 0", "trainer.checkpoint_every_s": ">= 0", "trainer.checkpoint_keep": ">= 1", "trainer.max_restarts": ">= 0",
    "trainer.eval_samples": ">= 1", "trainer.target_window": ">= 1", "trainer.stall_timeout_s": "> 0",
    "trainer.max_train_s": ">= 0", "trainer.max_generated_samples": ">= 0",
    "trainer.record_file_mb": ">= 1", "trainer.record_file_age_s": "> 0", "trainer.record_keep_mb": ">= 0",
    "trainer.log_file_mb": ">= 1", "trainer.log_files_kept": ">= 0",
    "cluster.num_generators": ">= 1", "cluster.object_store_mb": ">= 64", "cluster.segment_shards": ">= 1",
    "cluster.mailbox_capacity": ">= 1", "cluster.lease_s": "> 0", "cluster.generator_timeout_s": "> 0",
    "cluster.drain_timeout_s": ">= 0", "cluster.min_generators": ">= 1", "cluster.max_generators": ">= 1",
    "cluster.autoscale_every_s": "> 0",
    "offline.epochs": ">= 1", "offline.batch_trajectories": ">= 1",
}

ENDPOINT_KINDS = ("verifier", "genrm", "bt", "prm")
MODES = ("train", "generate", "learn")
# Names the algorithms accept, owned here so that checking them needs no torch import (the
# estimators' names are the keys of `asyncrl.algo.advantages.ADVANTAGES`, read when checking).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
FILTER_METRICS = ("acc", "score")
BEHAVIOUR_CORRECTIONS = ("token_tis", "sequence_tis", "token_mis", "sequence_mis")
KL_ESTIMATORS = ("k1", "k2", "low_var_kl")


def _in_range(value: float, bounds: str) -> bool:
    if bounds.startswith((">", "<")):
        op, limit = bounds.split()
        return {">=": value >= float(limit), ">": value > float(limit)}[op]
    low, high = (float(x) for x in bounds[1:-1].split(","))
    return ((value >= low) if bounds[0] == "[" else (value > low)) and ((value <= high) if bounds[-1] == "]" else (value < high))


def range_checks(config) -> list[tuple[bool, str]]:
    """Every field of RANGES (each entry of a mapping or list for `*`) against its bounds."""
    def values(node, parts, path):
        if not parts:
            yield path, node
        elif parts[0] == "*":
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                yield from values(child, parts[1:], f"{path}.{key}")
        else:
            yield from values(getattr(node, parts[0]), parts[1:], f"{path}.{parts[0]}" if path else parts[0])

    checks = []
    for pattern, bounds in RANGES.items():
        for path, value in values(config, pattern.split("."), ""):
            if value is not None:
                checks.append((_in_range(value, bounds), f"{path}={value} is out of range: it must be "
                                              f"{bounds if bounds[0] in '<>' else 'in ' + bounds}"))
    return checks


def validate(config) -> None:
    """Ranges, then cross-field checks that the schema alone cannot express."""
    for ok, message in [*range_checks(config), *_algorithm_checks(config), *_placement_checks(config),
                        *_mode_checks(config), *_reward_checks(config)]:
        if not ok:
            raise ConfigError(message)


def _estimator_kind(name: str) -> str | None:
    from asyncrl.algo.advantages import ADVANTAGES

    return ADVANTAGES[name].kind if name in ADVANTAGES else None


def _algorithm_checks(config) -> list[tuple[bool, str]]:
    from asyncrl.algo.advantages import ADVANTAGES
    from asyncrl.config.files import config_groups

    e, a, p = config.engine, config.algorithm, config.policy
    kind = _estimator_kind(a.estimator)
    value_based = kind == "value"
    renamed = " (group is now grpo; drgrpo for an unscaled group mean)" if a.estimator == "group" else ""
    return [
        (e.long_tail_tokens <= e.max_response_tokens, "engine.long_tail_tokens must be <= engine.max_response_tokens"),
        (a.name in config_groups().get("algorithm", [a.name]),
         f"algorithm.name must name a file of configs/algorithm/ ({', '.join(config_groups().get('algorithm', []))})"),
        (kind is not None, f"algorithm.estimator must be one of {sorted(ADVANTAGES)}{renamed}"),
        (p.loss_agg in LOSS_AGG_MODES, f"policy.loss_agg must be one of {LOSS_AGG_MODES}"),
        (p.dual_clip is None or p.dual_clip > 1, "policy.dual_clip must be > 1 (or null)"),
        (a.overlong_buffer_tokens < e.max_response_tokens,
         "algorithm.overlong_buffer_tokens must be < engine.max_response_tokens"),
        (not a.window_training or value_based,
         "algorithm.window_training needs algorithm.estimator=gae (windows have no outcome to normalise)"),
        (a.egae_bootstrap in ("previous", "next"), "algorithm.egae_bootstrap must be previous or next"),
        (a.filter_metric in FILTER_METRICS, f"algorithm.filter_metric must be one of {FILTER_METRICS}"),
        (a.kl_estimator in KL_ESTIMATORS, f"algorithm.kl_estimator must be one of {KL_ESTIMATORS}"),
        (p.rollout_correction in ("none", *BEHAVIOUR_CORRECTIONS),
         f"policy.rollout_correction must be none or one of {BEHAVIOUR_CORRECTIONS}"),
        (not a.kl_in_reward or (value_based and a.kl_coef > 0),
         "algorithm.kl_in_reward needs algorithm.estimator=gae (token rewards feed GAE) and algorithm.kl_coef > 0"),
        (not a.window_training or not any(route.dense for route in config.reward.routes),
         "process rewards (reward.routes[*].dense) cannot train T-PPO's windows: a process reward model "
         "scores a finished response, after its earlier windows were trained; use algorithm=vapo or ppo "
         "(whole responses), or drop the dense endpoints"),
        *_unhonoured(config, kind),
        (config.critic.head_init in ("mean_return", "zero"), "critic.head_init must be mean_return or zero"),
        (config.critic.warmup_min_steps <= max(config.critic.warmup_steps, config.critic.warmup_min_steps)
         and (config.critic.warmup_steps == 0 or config.critic.warmup_min_steps <= config.critic.warmup_steps),
         "critic.warmup_min_steps must be <= critic.warmup_steps"),
        (not config.trainer.synchronous or a.max_staleness_versions == 0,
         "trainer.synchronous needs algorithm.max_staleness_versions=0"),
        (config.model.source in ("tiny", "gguf", "hf"), "model.source must be tiny, gguf or hf"),
        (config.task.reward in ("zero_one", "plus_minus"), "task.reward must be zero_one or plus_minus"),
        (config.task.pre_ppo_fraction == 0 or config.task.pre_ppo_endpoint in config.reward.endpoints,
         "task.pre_ppo_endpoint must name an entry of reward.endpoints"),
    ]


def _unhonoured(config, kind: str | None) -> list[tuple[bool, str]]:
    """A setting the chosen estimator would not use is refused, saying why (never a silent no-op)."""
    a, c = config.algorithm, config.critic
    if kind == "value":
        return [
            (not (a.window_training and a.dynamic_sampling),
             "algorithm.dynamic_sampling cannot filter T-PPO's windows: they train as they stream, before "
             "their group is complete; set algorithm.dynamic_sampling=false, or algorithm.window_training=false "
             "to train whole responses (then groups are filtered)"),
            (a.max_refill_rounds == 0,
             "algorithm.max_refill_rounds bounds how long a group estimator's batch waits for groups with a "
             "signal; the value-based estimator cuts batches by finished samples: set it to 0"),
        ]
    gae_only = [name for name, used in (("length_adaptive_alpha", a.length_adaptive_alpha > 0),
                                        ("edge_mask_tokens", a.edge_mask_tokens > 0),
                                        ("whiten_advantages", a.whiten_advantages),
                                        ("advantage_clamp", a.advantage_clamp > 0),
                                        ("egae_bootstrap", a.egae_bootstrap != "previous")) if used]
    return [
        (not gae_only, f"algorithm.{', algorithm.'.join(gae_only)} shape (E)GAE advantages, which "
                       f"algorithm.estimator={a.estimator} does not compute: use a value-based algorithm "
                       f"(estimator gae) or leave them at their defaults"),
        (not c.init_path, "critic.init_path initialises the value learner, which only a value-based algorithm "
                          "(estimator gae) has"),
    ]


def _placement_checks(config) -> list[tuple[bool, str]]:
    e, p, c = config.engine, config.policy, config.critic
    return [
        (e.name in ("torch", "sglang"), "engine.name must be torch or sglang"),
        (e.device in ("cpu", "cuda"), "engine.device must be cpu or cuda"),
        (e.dtype in ("auto", "float32", "bfloat16"), "engine.dtype must be auto, float32 or bfloat16"),
        (p.device in ("cpu", "cuda"), "policy.device must be cpu or cuda"),
        (c.device in ("cpu", "cuda"), "critic.device must be cpu or cuda"),
        (p.precision in ("auto", "fp32", "bf16"), "policy.precision must be auto, fp32 or bf16"),
        (c.precision in ("auto", "fp32", "bf16"), "critic.precision must be auto, fp32 or bf16"),
        (config.cluster.placement in ("any", "colocated", "spread"), "cluster.placement must be any, colocated or spread"),
        (config.cluster.min_generators <= config.cluster.max_generators,
         "cluster.min_generators must be <= cluster.max_generators"),
        (not config.cluster.autoscale or config.cluster.min_generators <= config.cluster.num_generators
         <= config.cluster.max_generators, "cluster.num_generators must lie in [min_generators, max_generators] "
                                           "when cluster.autoscale is on"),
        (e.device != "cuda" or e.gpus > 0, "a generator on CUDA (engine.device=cuda) needs engine.gpus > 0"),
        (p.device != "cuda" or p.gpus > 0, "policy.device=cuda needs policy.gpus > 0"),
        (c.device != "cuda" or c.gpus > 0, "critic.device=cuda needs critic.gpus > 0"),
        (e.name != "sglang" or e.device == "cuda" or e.gpus == 0,
         f"engine.device=cpu with engine.gpus={e.gpus}: SGLang on CPU takes no GPU (engine.gpus=0, "
         "as engine=sglang sets on CPU)"),
        (e.name != "sglang" or e.device == "cuda" or e.sglang_max_total_tokens > 0,
         "engine=sglang on CPU needs engine.sglang_max_total_tokens > 0: its KV cache is ordinary RAM "
         "(engine=sglang sets 8192 on CPU)"),
        (e.name != "sglang" or not e.sglang_max_total_tokens or e.sglang_max_total_tokens > e.max_response_tokens,
         f"engine.sglang_max_total_tokens={e.sglang_max_total_tokens} cannot hold one response of "
         f"engine.max_response_tokens={e.max_response_tokens} and its prompt"),
        (p.weight_transport in ("auto", "shm", "cuda_ipc", "group"),
         "policy.weight_transport must be auto, shm, cuda_ipc or group"),
    ]


def _mode_checks(config) -> list[tuple[bool, str]]:
    a, offline = config.algorithm, config.offline
    return [
        (config.mode in MODES, f"mode must be one of {MODES}"),
        (config.mode != "generate" or config.trainer.record,
         "mode=generate keeps nothing but the store: set trainer.record=true"),
        (config.mode != "learn" or bool(offline.data), "mode=learn needs offline.data (a store or a file)"),
        (a.name != "dqo" or config.mode == "learn", "algorithm=dqo learns offline: run it with mode=learn"),
        (offline.train in ("policy", "value"), "offline.train must be policy or value"),
        (offline.train != "value" or _estimator_kind(a.estimator) == "value",
         "offline.train=value pretrains a critic: use a value-based algorithm (ppo, vcppo, vapo, tppo)"),
        (set(offline.statuses) <= {"kept", "dropped", "recorded"},
         "offline.statuses must be among kept, dropped, recorded"),
        (config.policy.ranks == 1 or config.mode == "train",
         "policy.ranks > 1 shards the online learner; mode=learn and mode=generate run one rank"),
        (config.trainer.max_train_s == 0 or config.mode == "train",
         "trainer.max_train_s bounds an online run (mode=train); mode=learn and mode=generate stop by their steps"),
        (config.trainer.max_generated_samples == 0 or config.mode == "train",
         "trainer.max_generated_samples bounds an online run (mode=train); mode=learn and mode=generate stop "
         "by their steps"),
    ]


def route_checks(routes: list[RouteConfig], endpoint_names: set[str]) -> list[tuple[bool, str]]:
    """Checks of reward routes (at start-up, and when the admin route changes them)."""
    checks = []
    for i, route in enumerate(routes):
        for name in [*route.endpoints, *route.dense]:
            checks.append((name in endpoint_names, f"reward.routes[{i}] names unknown endpoint {name!r}"))
        checks.append((bool(route.endpoints), f"reward.routes[{i}].endpoints must not be empty"))
        checks.append((route.combine in ("first", "mix"), f"reward.routes[{i}].combine must be first or mix"))
        checks.append((route.combine != "mix" or len(route.weights) == len(route.endpoints),
                       f"reward.routes[{i}].weights must give one weight per endpoint for combine=mix"))
    return checks


def _reward_checks(config) -> list[tuple[bool, str]]:
    r = config.reward
    checks = [(bool(r.endpoints), "reward.endpoints must name at least one endpoint")]
    for name, e in r.endpoints.items():
        checks.append((e.kind in ENDPOINT_KINDS, f"reward.endpoints.{name}.kind must be one of {ENDPOINT_KINDS}"))
        checks.append((e.kind not in ("bt", "prm") or bool(e.model_path), f"reward.endpoints.{name}.model_path is required for {e.kind}"))
        checks.append((e.judge_mode in ("pointwise", "pairwise"), f"reward.endpoints.{name}.judge_mode must be pointwise or pairwise"))
        # A process reward model scores every response token; an episode's observations are the
        # environment's, and its rewards would land on them.
        checks.append((e.kind != "prm" or not config.environment.name,
                       f"reward.endpoints.{name}: a process reward model (prm) cannot score episodes with an "
                       f"environment (environment.name={config.environment.name}): its token rewards would fall "
                       f"on the observations"))
    checks += route_checks(r.routes, set(r.endpoints))
    if _estimator_kind(config.algorithm.estimator) == "pairwise":
        judge = r.endpoints.get(config.algorithm.pairwise_endpoint)
        checks.append((judge is not None and judge.kind == "genrm",
                       "algorithm.pairwise_endpoint must name a genrm endpoint in reward.endpoints"))
    return checks
