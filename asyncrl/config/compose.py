"""Composing a config: Hydra's groups (`algorithm=vapo`), then typed dotted overrides.

`compose(overrides)` composes `configs/config.yaml` (or a user's recipe: `config_dir` and
`config_name`, with the package's groups still available) with the overrides. The same call serves
the CLI, `serve run` and tests. Every dotted override is walked along the schema
(`asyncrl.config.schema`), so that a mistake is one line naming the field, the nearest valid name
and the expected type; the composed whole is then converted to the typed `Config` (msgspec checks
every type, range and allowed name) and the cross-field rules are checked. A field of ours that
moved fails naming its new place (`RENAMED`); verl's and TRL's names are accepted with a notice
(`FOREIGN`); a run's `config.json` written before a move still loads (`migrate`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
from omegaconf import DictConfig, OmegaConf

from asyncrl.config.checks import ConfigError, validate
from asyncrl.config.files import config_dir, config_groups
from asyncrl.config.names import FOREIGN, ROLLOUT_ENGINES, foreign_notice, ignored_notice, ignored_reason
from asyncrl.config.renames import migrate, renamed_message
from asyncrl.config.run import Config
import asyncrl.config.schema as schema

log = logging.getLogger("asyncrl.config")


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


# Registered once, before any config is resolved.
for _name, _resolver in (("detected_device", detected_device), ("by_device", by_device)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _resolver)


def compose(overrides: list[str] | None = None, config_name: str = "config", user_dir: str | None = None,
            notices: list[str] | None = None, values: dict[str, Any] | None = None,
            until_stopped: bool = False) -> Config:
    """Compose the Hydra config with overrides and return it validated.

    `user_dir` (`--config-dir`): a directory of the user's recipes, searched before the package's,
    whose `config_name` is the primary config (it may list the package's `config` in its defaults).
    Hydra picks the config groups; every dotted override is applied here, walked along the schema:
    `+` only adds an entry to a mapping (`+reward.endpoints.judge={kind: genrm}`), never a field.
    `notices`: where the one-line notices for verl's and TRL's names go (default: the log).
    `values`: dotted fields set last, to what a checkpoint, a run directory or an endpoint said:
    data, never an override string, so nothing in them is parsed or interpolated (`set_values`).
    """
    user_dir = os.path.abspath(user_dir) if user_dir else None  # Hydra takes absolute directories only
    if user_dir and not os.path.isdir(user_dir):
        raise ConfigError(f"--config-dir {user_dir}: no such directory")
    parsed = _parse_overrides(list(overrides or []))
    groups = config_groups(user_dir)
    group_overrides = [o for o in parsed if o.key_or_group in groups]
    for override in group_overrides:
        _check_group_choice(override, groups[override.key_or_group])
    group_lines = [o.input_line for o in group_overrides] + _implied_groups(parsed, group_overrides)
    said = notices if notices is not None else []
    raw = _hydra_compose(config_name, group_lines, user_dir)
    ignored: list[str] = []
    merged = _with_defaults(raw, said, ignored)
    # Entries that add to a mapping first, so that a dotted name may come before the entry it sets
    # (`custom_reward_function.name=...` before `.path=...`); the order is otherwise the user's.
    for override in sorted((o for o in parsed if o not in group_overrides), key=_adds_first):
        if ignored_reason(override.key_or_group) is not None and not _ours(override.key_or_group, merged):
            ignored.append(override.key_or_group)
        else:
            _apply(merged, override, said)
    if ignored:
        said.append(ignored_notice(ignored))
    config = _derived(_convert(merged, values or {}))
    if not until_stopped:  # a Serve app trains until stopped: no trainer.total_steps to decay over
        with_decay_horizon(config)
    _check(config, groups)
    if notices is None:
        for line in said:
            log.warning(line)
    return config


# Names that select data files: they imply `task=file`, the task that reads them.
DATA_FILE_KEYS = ("task.path", "task.eval_path", *(k for k, e in FOREIGN.items()
                                                    if {"task.path", "task.eval_path"} & set(e.ours)))


def _implied_groups(parsed: list, group_overrides: list) -> list[str]:
    """`task=file` where a data file is named (verl's `data.train_files`, TRL's `dataset_name`, our
    `task.path`) and no task is; a built-in task named beside a data file is refused. verl's
    `actor_rollout_ref.rollout.name` with no `engine=` picks that engine's preset (its KV cache,
    devices and rollout correction), not `engine.name` alone."""
    return _implied_engine(parsed, group_overrides) + _implied_task(parsed, group_overrides)


def _implied_engine(parsed: list, group_overrides: list) -> list[str]:
    named = [o.value() for o in parsed if o.key_or_group == "actor_rollout_ref.rollout.name"]
    if not named or any(o.key_or_group == "engine" for o in group_overrides) or str(named[-1]) not in ROLLOUT_ENGINES:
        return []  # an unknown name is refused with the known ones when it is applied
    return [f"engine={ROLLOUT_ENGINES[str(named[-1])]}"]


def _implied_task(parsed: list, group_overrides: list) -> list[str]:
    files = [o.key_or_group for o in parsed if o.key_or_group.lstrip("+") in DATA_FILE_KEYS]
    if not files or any(o.key_or_group == "task.name" and o.value() == "file" for o in parsed):
        return []  # no file named, or a task's settings with the file task's name (`task=tiny task.name=file`)
    tasks = [o for o in group_overrides if o.key_or_group == "task"]
    if not tasks:
        return ["task=file"]
    named = tasks[-1].value()
    if named != "file":
        raise ConfigError(f"{files[0]} names a data file, which task=file reads, but task={named} is a built-in "
                          f"task with prompts of its own: drop task={named} (or {files[0]})")
    return []


def _adds_first(override) -> int:
    entry = FOREIGN.get(override.key_or_group)
    return 0 if override.is_add() or (entry is not None and entry.adds) else 1


def _ours(key: str, merged: DictConfig | None = None) -> bool:
    """Whether `key` names a field or entry of our config (never taken for another framework's)."""
    kind, node, path = Config, merged, ""
    try:
        for part in key.lstrip("+~").split("."):
            kind = schema.child(kind, node, part, path)
            node = node.get(part) if node is not None and hasattr(node, "get") else None
            path = f"{path}.{part}" if path else part
    except schema.SchemaError:
        return False
    return True


def _derived(config: Config) -> Config:
    """The values other fields decide, set once the config is composed."""
    if config.trainer.synchronous:
        # A synchronous batch is whole responses (cut windows would wait for a batch that never
        # fills); set here so that a task's window size cannot undo it.
        config.engine.window_tokens = config.engine.max_response_tokens
    if not config.model.name:
        config.model.name = config.model.directory_name()
    return config


def with_decay_horizon(config: Config) -> Config:
    """A run that stops at `trainer.total_steps` (`asyncrl train`, `mode=learn`): a decaying policy
    rate without `policy.optimizer.decay_steps` decays over those steps (one policy step a run step).
    A Serve app trains until stopped (`compose(until_stopped=True)`): its train app refuses a decay
    without the field set (`asyncrl.serve.train.build_train`)."""
    optimizer = config.policy.optimizer
    if optimizer.schedule != "constant" and not optimizer.decay_steps:
        optimizer.decay_steps = config.trainer.total_steps
    return config


def config_from_dict(data: dict) -> Config:
    """A config written by `to_dict` (a run's `config.json`, also one written before fields moved)
    back as a validated `Config`."""
    config = _derived(_typed(migrate(data)))  # data: an `${...}` in it stays text
    _check(config, None)
    return config


def to_dict(config: Config) -> dict:
    return msgspec.to_builtins(config)


SECRET_FIELDS = ("serve.admin_token", "serve.reward_token", "serve.api_key")
"""Fields that hold a secret: never written into a record (config.json, the wandb config). A key
of an API (the openai judge's) is never in the config at all: only the name of its variable."""
REDACTED = "<redacted>"


def to_record(config: Config) -> dict:
    """`to_dict` for what a run writes down: every secret field that is set reads "<redacted>"."""
    out = to_dict(config)
    for path in SECRET_FIELDS:
        section, name = path.split(".")
        if out[section][name]:
            out[section][name] = REDACTED
    return out


def to_yaml(config: Config) -> str:
    """The composed config as YAML (`asyncrl train --cfg`)."""
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(config)))


def _check(config: Config, groups: dict | None) -> None:
    validate(config)
    if groups is not None and config.algorithm.name not in groups.get("algorithm", [config.algorithm.name]):
        raise ConfigError(f"algorithm.name={config.algorithm.name} must name a recipe of the algorithm group "
                          f"({', '.join(groups['algorithm'])})")


def _hydra_compose(config_name: str, group_lines: list[str], user_dir: str | None) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    primary = user_dir or config_dir()
    extra = [f"hydra.searchpath=[file://{config_dir()}]"] if user_dir else []
    package_primary = os.path.join(config_dir(), f"{config_name}.yaml")
    if user_dir and not os.path.isfile(os.path.join(user_dir, f"{config_name}.yaml")) and os.path.isfile(package_primary):
        # Hydra looks the primary recipe up in --config-dir only: the package's is stored under a name
        # of its own (the same name would make it a schema of the file), the user's options still first.
        from hydra.core.config_store import ConfigStore

        config_name = f"asyncrl_package_{config_name}"
        ConfigStore.instance().store(name=config_name, node=OmegaConf.load(package_primary))
    try:
        with initialize_config_dir(config_dir=str(primary), version_base=None, job_name="asyncrl"):
            return hydra_compose(config_name=config_name, overrides=group_lines + extra)
    except Exception as exc:  # a broken YAML file of a group, or a missing recipe: Hydra's first line names it
        raise ConfigError(f"invalid config: {_first_line(exc)}") from exc


def _with_defaults(raw: DictConfig, said: list[str], ignored: list[str]) -> DictConfig:
    """The schema's defaults with the composed YAML merged on top (a union whose YAML picks another
    variant starts from that variant's defaults); names of other frameworks in the YAML translated,
    verl's infrastructure settings set aside into `ignored`."""
    data = OmegaConf.to_container(raw, resolve=False)
    leaves = list(_leaves(data))
    foreign = [(key, value) for key, value in leaves if key in FOREIGN]
    for key, _ in leaves:
        _drop(data, key)
    ignored += [key for key, _ in leaves if key not in FOREIGN]
    merged = OmegaConf.create(_merge(msgspec.to_builtins(Config()), data, Config, ""))
    for key, value in foreign:
        _apply_foreign(merged, key, value, key, said)
    return merged


def _merge(base, update, kind, path: str):
    """`update` over `base` along the schema: sections merge field by field; a union replaces
    `base` by the defaults of the variant `update` names; anything else is replaced."""
    union = schema.variants(kind)
    if union is not None and isinstance(update, dict) and isinstance(base, dict):
        field = schema.tag_field(union)
        tag = update.get(field, base.get(field))
        if tag != base.get(field) and tag in union:
            base = msgspec.to_builtins(union[tag]())
        kind = union.get(tag, kind)
    if isinstance(base, dict) and isinstance(update, dict):
        out = dict(base)
        for key, value in update.items():
            try:
                sub = schema.child(kind, base, key, path)
            except schema.SchemaError:
                sub = None  # reported by the conversion, with its path
            out[key] = _merge(base.get(key), value, sub, f"{path}.{key}" if path else key) if key in base else value
        return out
    return update


def _convert(merged: DictConfig, values: dict[str, Any]) -> Config:
    try:
        data = OmegaConf.to_container(merged, resolve=True)
    except Exception as exc:
        raise ConfigError(f"invalid config: {_first_line(exc)}") from exc
    set_values(data, values)  # after the resolution: OmegaConf never sees them
    return _typed(data)


def _typed(data: dict) -> Config:
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(schema.conversion_message(Config, data, str(exc))) from exc


def set_values(data: dict, values: dict[str, Any]) -> None:
    """Set dotted fields of a resolved config's `data` to `values` as they are: settings read from a
    checkpoint, a run directory or an endpoint are data, so an `${...}` in them stays text. A value
    its field does not take is a `ConfigError` naming the field."""
    for key, value in values.items():
        problem = value_problem(key, value, data)
        if problem is not None:
            raise ConfigError(problem)
        *parents, name = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[name] = value


def value_problem(key: str, value: Any, data: dict | None = None) -> str | None:
    """Why dotted field `key` cannot take `value` (None when it can). `data`: the config it goes
    into (default: the defaults), whose unions' tags decide which fields there are."""
    node, kind, path = to_dict(Config()) if data is None else data, Config, ""
    try:
        for part in key.split("."):
            kind = schema.child(kind, node, part, path)
            node = node.get(part) if isinstance(node, dict) else None
            path = f"{path}.{part}" if path else part
    except schema.SchemaError as exc:
        return str(exc)
    return schema.value_error(key, kind, value)


def _leaves(data, prefix: str = ""):
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if path in FOREIGN or (ignored_reason(path) is not None and not _ours(path)):
                yield path, value
            else:
                yield from _leaves(value, path)


def _drop(data: dict, path: str) -> None:
    *parents, name = path.split(".")
    nodes = [data]
    for part in parents:
        nodes.append(nodes[-1][part])
    del nodes[-1][name]
    for part, node in zip(reversed(parents), reversed(nodes[:-1])):
        if not node[part]:
            del node[part]


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


def _check_group_choice(override, options: list[str]) -> None:
    choice = override.value()
    if override.is_delete() or choice in options:
        return
    raise ConfigError(f"{override.input_line}: no {override.key_or_group} named {choice!r}"
                      f"{schema.nearest(str(choice), options)} (choices: {', '.join(options)})")


def _apply(merged: DictConfig, override, said: list[str]) -> None:
    from asyncrl.config.overrides import assign

    key, line = override.key_or_group, override.input_line
    if key in FOREIGN:
        _apply_foreign(merged, key, override.value(), line, said)
        return
    moved = renamed_message(key)
    if moved is not None:
        raise ConfigError(f"{line}: {moved}")
    assign(merged, key, override.value(), line, add=override.is_add(), delete=override.is_delete())


def _apply_foreign(merged: DictConfig, key: str, value, line: str, said: list[str]) -> None:
    from asyncrl.config.overrides import assign

    entry = FOREIGN[key]
    if entry.refused:
        raise ConfigError(f"{line}: {key} ({entry.framework}'s name) has no counterpart here: {entry.refused}")
    try:
        assignments = entry.translate(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{line}: {exc}") from exc
    for ours, ours_value in assignments:
        assign(merged, ours, ours_value, line, add=entry.adds)
    said.append(foreign_notice(key, entry, assignments))


