"""One dotted override applied to a composed config, walked along the schema (`asyncrl.config.schema`):
the key must be a field, an entry of a mapping, an index of a list, or a field of the variant a
union holds; the value must fit the field's type, range and names. Setting a union's tag
(`algorithm.advantage.type=gae`) switches the variant, starting from its defaults.
"""

from __future__ import annotations

import msgspec
from omegaconf import DictConfig, OmegaConf, open_dict

import asyncrl.config.schema as schema
from asyncrl.config.checks import ConfigError
from asyncrl.config.run import Config


def assign(merged: DictConfig, key: str, value, line: str, add: bool = False, delete: bool = False) -> None:
    """Set (or, for an entry of a mapping, remove) `key` in `merged`; every mistake is a
    `ConfigError` of one line that starts with the override's own text."""
    parts = key.split(".")
    parent, kind, path = merged, Config, ""
    for i, part in enumerate(parts[:-1]):
        kind, parent, path = _descend(merged, parent, kind, part, path, add, line)
    last = parts[-1]
    union = schema.variants(kind)
    if union is not None and last == schema.tag_field(union):
        _switch_variant(parent, union, value, path, line)
        return
    try:
        field_kind = schema.child(kind, parent, last, path)
    except schema.SchemaError as exc:
        if _is_mapping(kind) and add:
            field_kind = _mapping_value(kind)
        else:
            raise ConfigError(f"{line}: {_with_group_hint(exc, parts, value, i=len(parts) - 1)}") from exc
    at = f"{path}.{last}" if path else last
    if delete:
        if not _is_mapping(kind):
            raise ConfigError(f"{line}: {at} is a field of the schema and cannot be removed; only entries of a "
                              f"mapping (e.g. ~reward.endpoints.genrm) can be")
        with open_dict(parent):
            del parent[last]
        return
    _set(parent, last, field_kind, value, at, line)


def _descend(merged, node, kind, part: str, path: str, add: bool, line: str):
    """One step down: the child's type, its node (created for `+` of a new mapping entry), its path."""
    at = f"{path}.{part}" if path else part
    try:
        sub = schema.child(kind, node, part, path)
    except schema.SchemaError as exc:
        if not (add and _is_mapping(kind)):
            raise ConfigError(f"{line}: {_with_group_hint(exc, at.split('.'), None, i=len(at.split('.')) - 1)}") from exc
        sub = _mapping_value(kind)
        with open_dict(node):
            node[part] = msgspec.to_builtins(_default_of(sub))
    child_node = node[int(part)] if isinstance(node, list) or part.isdigit() and not hasattr(node, "keys") else node[part]
    return sub, child_node, at


def _set(parent, last: str, kind, value, at: str, line: str) -> None:
    union = schema.variants(kind)
    if union is not None and isinstance(value, dict):
        field = schema.tag_field(union)
        current = parent.get(last) if last in parent else None
        tag = value.get(field, current.get(field) if current is not None else None)
        if tag not in union:
            raise ConfigError(f"{line}: {at}.{field} must be one of {', '.join(union)} (got {tag!r})")
        if current is None or current.get(field) != tag:
            base = msgspec.to_builtins(union[tag]()) if _has_defaults(union[tag]) else {field: tag}
            with open_dict(parent):
                parent[last] = OmegaConf.merge(OmegaConf.create(base), value)
        else:
            parent[last] = OmegaConf.merge(current, value)
        problem = schema.value_error(at, kind, OmegaConf.to_container(parent[last], resolve=True))
    elif schema.is_section(kind) and isinstance(value, dict) and last in parent:
        parent[last] = OmegaConf.merge(parent[last], value)
        problem = schema.value_error(at, kind, OmegaConf.to_container(parent[last], resolve=True))
    else:
        problem = schema.value_error(at, kind, value)
        if problem is None:
            with open_dict(parent):
                parent[last] = value
    if problem is not None:
        raise ConfigError(problem if problem.startswith(line) else f"{line}: {problem}")


def _switch_variant(node, union: dict[str, type], tag, path: str, line: str) -> None:
    field = schema.tag_field(union)
    if tag not in union:
        raise ConfigError(f"{line}: {path}.{field} must be one of {', '.join(union)}{schema.nearest(str(tag), union)}")
    if node.get(field) == tag:
        return
    for key in list(node.keys()):
        del node[key]
    for key, value in (msgspec.to_builtins(union[tag]()) if _has_defaults(union[tag]) else {field: tag}).items():
        node[key] = value


def _has_defaults(variant: type) -> bool:
    return all(f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
               for f in msgspec.structs.fields(variant))


def _default_of(kind):
    """A new mapping entry's starting value: the section's defaults ({} for a union: its tag comes next)."""
    if schema.is_section(kind) and _has_defaults(schema.bare(kind)):
        return schema.bare(kind)()
    return {}


def _is_mapping(kind) -> bool:
    import typing

    return typing.get_origin(schema.bare(kind)) is dict


def _mapping_value(kind):
    import typing

    return typing.get_args(schema.bare(kind))[1]


def _with_group_hint(exc: schema.SchemaError, parts: list[str], value, i: int) -> str:
    """`modle=tiny`: a group's name mistyped, with its value one of the group's options."""
    from asyncrl.config.files import config_groups

    message = str(exc)
    if "has no field" not in message:
        return message
    if i == 0 and value is not None:
        groups = [g for g, options in config_groups().items() if str(value) in options]
        hint = schema.nearest(parts[0], groups)
        if hint:
            return f"the config has no field {parts[0]!r}{hint}"
    if "did you mean" in message or "it is a field of" in message:
        return message
    hint = schema.elsewhere(Config, parts[i])
    return message.split(" (fields:")[0] + hint if hint else message
