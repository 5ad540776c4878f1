"""Our own old dotted names: `RENAMED` (refused with a "moved to" message, never a silent alias)
and `migrate`, which moves the fields of a run's `config.json` written before a rename."""

from __future__ import annotations

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
