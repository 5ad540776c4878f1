"""Composing a config: Hydra's groups (`algorithm=vapo`) and typed dotted overrides.

`compose(overrides)` composes `configs/config.yaml` with the overrides (the same call serves the
CLI, `serve run` and tests), applies every dotted override to the typed schema so that a mistake
is one line naming the field, the nearest valid name and the expected type, checks the result
(`asyncrl.config.checks`) and returns a plain `Config`. A field that moved to another section
fails naming its new place (`RENAMED`); a run's `config.json` written before the move still loads.
"""

from __future__ import annotations

import types

from omegaconf import OmegaConf, open_dict

from asyncrl.config.checks import ConfigError, validate
from asyncrl.config.files import config_dir, config_groups
from asyncrl.config.run import Config

# Fields that moved (old dotted name -> new one; None: removed, with what replaces it in the message).
RENAMED: dict[str, str | None] = {
    **{f"algorithm.{name}": f"policy.{name}" for name in (
        "lr", "weight_decay", "grad_clip", "warmup_steps", "clip_low", "clip_high", "dual_clip", "loss_agg",
        "loss_norm_tokens", "entropy_coef", "ppo_epochs", "mini_batches", "proximal_anchor", "behaviour_weight_cap",
        "rollout_correction", "rollout_is_cap", "micro_batch_tokens")},
    **{f"algorithm.{name}": f"task.{name}" for name in (
        "retire_after_groups", "retire_epochs", "retire_unsolved", "retest_every_s")},
    **{f"trainer.{old}": f"policy.{new}" for old, new in (
        ("learner_device", "device"), ("learner_precision", "precision"),
        ("gradient_checkpointing", "gradient_checkpointing"), ("logits_chunk_tokens", "logits_chunk_tokens"),
        ("learner_threads", "threads"), ("learner_gpus", "gpus"), ("learner_resources", "resources"),
        ("learner_ranks", "ranks"), ("learner_timeout_s", "timeout_s"),
        ("broadcast_bucket_mb", "broadcast_bucket_mb"), ("weight_transport", "weight_transport"))},
    **{f"trainer.{old}": f"engine.{new}" for old, new in (("generator_gpus", "gpus"),
                                                          ("generator_resources", "resources"))},
    **{f"trainer.{name}": f"cluster.{name}" for name in (
        "num_generators", "placement", "ray_address", "object_store_mb", "mailbox_capacity", "segment_shards",
        "lease_s")},
    "trainer.generator_threads": None,
    "algorithm.scale_advantage_by_std": None,
}
# What replaces a removed field.
REMOVED_BECAUSE = {
    "trainer.generator_threads": "it was read by nothing; a generator's threads are engine.threads",
    "algorithm.scale_advantage_by_std": "the estimator says it: algorithm.estimator=grpo (scaled by the group's "
                                        "std) or drgrpo (not scaled)",
}


def detected_device() -> str:
    """`cuda` where torch sees a GPU, else `cpu`: a preset's `engine.device` (`${detected_device:}`)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def by_device(device: str, on_cuda, on_cpu):
    """A preset's value that depends on the device (`${by_device:${engine.device},0.5,0}`): the
    `engine=sglang` preset serves a GPU and this CPU alike, and follows `engine.device=cpu`."""
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"engine.device must be cpu or cuda, not {device!r}")
    return on_cuda if device == "cuda" else on_cpu


# Registered once, before any config is resolved (to_object resolves the presets' interpolations).
for _name, _resolver in (("detected_device", detected_device), ("by_device", by_device)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _resolver)


def compose(overrides: list[str] | None = None, config_name: str = "config") -> Config:
    """Compose the Hydra config with overrides and validate it against the `Config` schema.

    Hydra picks the config groups (`algorithm=vapo`); every dotted override is then applied to the
    typed config here, so that a mistake is one line naming the field, the nearest valid name and
    the expected type, and `+` never adds a field the schema does not have (Hydra's `+` would add
    it and the dataclass would silently drop it). `+` adds an entry to a mapping, e.g.
    `+reward.endpoints.judge={kind: genrm}`.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore

    parsed = _parse_overrides(list(overrides or []))
    groups = config_groups()
    group_overrides = [o for o in parsed if o.key_or_group in groups]
    value_overrides = [o for o in parsed if o.key_or_group not in groups]
    for override in group_overrides:
        _check_group_choice(override, groups[override.key_or_group])
    # The dataclass schema is the base of configs/config.yaml: every field is typed.
    ConfigStore.instance().store(name="asyncrl_schema", node=Config)
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base=None, job_name="asyncrl"):
            raw = hydra_compose(config_name=config_name, overrides=[o.input_line for o in group_overrides])
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    except Exception as exc:  # a broken YAML file of a group: Hydra's first line names it
        raise ConfigError(f"invalid config: {_first_line(exc)}") from exc
    for override in value_overrides:
        _apply_override(merged, override)
    try:
        config: Config = OmegaConf.to_object(merged)
    except Exception as exc:
        raise ConfigError(f"invalid config: {_first_line(exc)}") from exc
    if config.trainer.synchronous:
        # A synchronous batch is whole responses (cut windows would wait for a batch that never
        # fills); set here so that a task's window size cannot undo it.
        config.engine.window_tokens = config.engine.max_response_tokens
    validate(config)
    return config



def config_from_dict(data: dict) -> Config:
    """A config written by `to_dict` (a run's `config.json`, also one written before fields moved)
    back as a validated `Config`."""
    try:
        config: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), migrate(data)))
    except Exception as exc:
        raise ConfigError(f"invalid config: {_first_line(exc)}") from exc
    validate(config)
    return config


def migrate(data: dict) -> dict:
    """Move the fields of an older config dict to their sections of today (`RENAMED`)."""
    data = {section: dict(values) if isinstance(values, dict) else values for section, values in data.items()}
    for old, new in RENAMED.items():
        section, name = old.split(".")
        if not isinstance(data.get(section), dict) or name not in data[section]:
            continue
        value = data[section].pop(name)
        if new is None:
            if old == "algorithm.scale_advantage_by_std" and value is False:
                data["algorithm"]["estimator"] = "drgrpo"
            continue
        to_section, to_name = new.split(".")
        data.setdefault(to_section, {})[to_name] = value
    if isinstance(data.get("algorithm"), dict) and data["algorithm"].get("estimator") == "group":
        data["algorithm"]["estimator"] = "grpo"
    return data


def renamed_message(key: str) -> str | None:
    """The one line for a field that moved or was removed (None for any other key)."""
    if key not in RENAMED:
        return None
    new = RENAMED[key]
    if new is None:
        return f"{key} was removed: {REMOVED_BECAUSE[key]}"
    return f"{key} moved to {new} (the {new.split('.')[0]} section: the role that reads it); write {new}=..."


def _first_line(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return (str(cause).strip().splitlines() or [type(cause).__name__])[0]


def _parse_overrides(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = []
    for line in overrides:
        try:
            (override,) = parser.parse_overrides([line])
        except Exception as exc:
            raise ConfigError(f"{line!r} is not an override (key=value, +key=value or group=option): "
                              f"{_first_line(exc)}") from exc
        if override.is_sweep_override():
            raise ConfigError(f"{line!r}: sweeps (a,b or range()) are not supported; run once per value")
        parsed.append(override)
    return parsed


def _nearest(word: str, options) -> str:
    import difflib

    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_group_choice(override, options: list[str]) -> None:
    choice = override.value()
    if override.is_delete() or choice in options:
        return
    raise ConfigError(f"{override.input_line}: no {override.key_or_group} named {choice!r}"
                      f"{_nearest(str(choice), options)} (choices: {', '.join(options)})")




def _apply_override(merged, override) -> None:
    """Walk the schema along the dotted key, then set (or delete) the value with its type checked."""
    import typing
    from dataclasses import is_dataclass

    key, line = override.key_or_group, override.input_line
    moved = renamed_message(key)
    if moved is not None:
        raise ConfigError(f"{line}: {moved}")
    parts = key.split(".")
    node, kind = merged, Config
    for i, part in enumerate(parts):
        at = ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        kind = _strip_optional(kind)
        if is_dataclass(kind):
            hints = typing.get_type_hints(kind)
            if part not in hints:
                section = ".".join(parts[:i]) or "the config"
                # `modle=tiny`: a group's name mistyped, and its value one of the group's options.
                groups = {g for g, options in config_groups().items() if str(override.value()) in options} if i == 0 else set()
                hint = _nearest(part, groups) or _nearest(part, hints) or (_in_another_section(parts[0], part)
                                                                            if i == 1 else "")
                raise ConfigError(f"{line}: {section} has no field {part!r}"
                                  f"{hint or ' (fields: ' + ', '.join(hints) + ')'}")
            if last and override.is_delete():
                raise ConfigError(f"{line}: {at} is a field of the schema and cannot be removed; set it instead")
            kind = hints[part]
        elif typing.get_origin(kind) is dict:
            value_kind = typing.get_args(kind)[1]
            if part not in node:
                entries = ", ".join(map(str, node)) or "none"
                if not override.is_add():
                    raise ConfigError(f"{line}: {'.'.join(parts[:i])} has no entry {part!r}{_nearest(part, node)} "
                                      f"(entries: {entries}); to add one, write +{at}=...")
                if not last and is_dataclass(value_kind):
                    with open_dict(node):
                        node[part] = OmegaConf.structured(value_kind)
            elif last and override.is_delete():
                with open_dict(node):
                    del node[part]
                return
            kind = value_kind
        elif typing.get_origin(kind) is list:
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{line}: {'.'.join(parts[:i])} has {len(node)} entries; {part!r} is not one of them")
            part, kind = int(part), typing.get_args(kind)[0]
        else:
            raise ConfigError(f"{line}: {'.'.join(parts[:i])} is {_describe(kind)} and has no field {part!r}")
        if not last:
            node = node[part]
    if override.is_delete():
        raise ConfigError(f"{line}: only entries of a mapping (e.g. ~reward.endpoints.genrm) can be removed")
    value = override.value()
    try:
        if is_dataclass(_strip_optional(kind)) and isinstance(value, dict) and part not in node:
            with open_dict(node):  # a new entry of a mapping, typed by the schema
                node[part] = OmegaConf.merge(OmegaConf.structured(_strip_optional(kind)), value)
        elif typing.get_origin(_strip_optional(kind)) is dict and not is_dataclass(typing.get_args(_strip_optional(kind))[1]):
            with open_dict(merged):  # a mapping of plain values takes new keys
                OmegaConf.update(merged, key, value, merge=True)
        else:
            OmegaConf.update(merged, key, value, merge=True)
    except Exception as exc:
        got = override.get_value_element_as_str()
        detail = f" ({_first_line(exc)})" if isinstance(value, (dict, list)) else ""
        raise ConfigError(f"{line}: {key} expects {_describe(kind)}, got {got!r}{detail}") from exc


def _in_another_section(section: str, name: str) -> str:
    """`algorithm.clip_hgh`: the nearest field of the other sections (`policy.clip_high` or
    `critic.clip_high`), as a hint."""
    import difflib
    import typing
    from dataclasses import is_dataclass

    sections = {key: kind for key, kind in typing.get_type_hints(Config).items() if key != section and is_dataclass(kind)}
    fields = {field for kind in sections.values() for field in typing.get_type_hints(kind)}
    close = difflib.get_close_matches(name, sorted(fields), n=1, cutoff=0.75)
    if not close:
        return ""
    places = [f"'{key}.{close[0]}'" for key, kind in sections.items() if close[0] in typing.get_type_hints(kind)]
    return f"; did you mean {' or '.join(places)}?"


def _strip_optional(kind):
    import typing

    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def _describe(kind) -> str:
    import typing
    from dataclasses import is_dataclass

    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    inner = _strip_optional(kind)
    suffix = " or null" if inner is not kind else ""
    if inner in names:
        return names[inner] + suffix
    if is_dataclass(inner):
        return f"a mapping of {inner.__name__} fields ({', '.join(typing.get_type_hints(inner))})" + suffix
    origin = typing.get_origin(inner)
    if origin is list:
        return f"a list of {_describe(typing.get_args(inner)[0])}" + suffix
    if origin is dict:
        return f"a mapping to {_describe(typing.get_args(inner)[1])}" + suffix
    return str(inner) + suffix


# Ranges of numeric fields: ">= 1", "> 0", "[0, 1]" or "(0, 1]"; `*` matches any entry of a
# mapping; a null (where the field allows it) is always in range.


def to_dict(config: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)


# Fields that hold a secret: never written into a record (config.json, the wandb config).
SECRET_FIELDS = ("serve.admin_token", "serve.reward_token")


def to_record(config: Config) -> dict:
    """`to_dict` for what a run writes down: every secret field that is set reads "<redacted>"."""
    out = to_dict(config)
    for path in SECRET_FIELDS:
        section, name = path.split(".")
        if out[section][name]:
            out[section][name] = "<redacted>"
    return out
