"""The one walker over the config schema: what type a dotted path has (a section's field, an entry of
a mapping or a list, a union's variant chosen by its tag), how a type is described to a user, and
the message for a value a field does not take (its type, its range, its allowed names). The
override parser, the conversion of a composed config and `asyncrl train --help` all read the
schema through it, so a range or a name is written once, on the field.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from functools import cache

import msgspec

from asyncrl.config.fields import Section, tag_field_of, tag_of


class SchemaError(LookupError):
    """A path the schema does not have; the message says what it has."""


@cache
def hints(cls: type) -> dict[str, object]:
    """A section's fields and their types, ranges kept (`Annotated`)."""
    return typing.get_type_hints(cls, include_extras=True)


def bare(kind):
    """The type without its range (`Annotated`) and without `| None`."""
    kind = strip_annotated(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return strip_annotated(args[0])
    return kind


def strip_annotated(kind):
    return typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind


def is_section(kind) -> bool:
    return isinstance(bare(kind), type) and issubclass(bare(kind), Section)


def variants(kind) -> dict[str, type] | None:
    """A union of tagged sections -> {tag: variant class}; None for any other type."""
    kind = bare(kind)
    if typing.get_origin(kind) not in (typing.Union, types.UnionType):
        return None
    members = typing.get_args(kind)
    if not all(isinstance(m, type) and issubclass(m, Section) for m in members):
        return None
    return {tag_of(m): m for m in members}


def tag_field(union: dict[str, type]) -> str:
    return tag_field_of(next(iter(union.values())))


def nearest(word: str, options, cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(word, [str(o) for o in options], n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else ""


def variant_of(union: dict[str, type], node, path: str) -> type:
    """The variant a union's node holds, by its tag."""
    field = tag_field(union)
    tag = node.get(field) if hasattr(node, "get") else None
    if tag not in union:
        raise SchemaError(f"{path}.{field} must be one of {', '.join(union)} (got {tag!r})")
    return union[tag]


def child(kind, node, part: str, path: str):
    """The type of `part` under a value of type `kind` (`node`: that value, as composed so far, to
    read a union's tag or a mapping's entries). Raises `SchemaError` naming what is there."""
    union = variants(kind)
    if union is not None:
        variant = variant_of(union, node, path)
        if part == tag_field(union):
            return str
        if part not in hints(variant):
            owners = [tag for tag, cls in union.items() if part in hints(cls)]
            where = (f"; it is a field of {' and '.join(owners)}: set {path}.{tag_field(union)} first" if owners
                     else nearest(part, hints(variant)) or f" (fields: {', '.join(hints(variant)) or 'none'})")
            raise SchemaError(f"{path} is {tag_field(union)} {tag_of(variant)}, which has no field {part!r}{where}")
        return hints(variant)[part]
    inner = bare(kind)
    if is_section(inner):
        if part not in hints(inner):
            raise SchemaError(f"{path or 'the config'} has no field {part!r}"
                              f"{nearest(part, hints(inner)) or ' (fields: ' + ', '.join(hints(inner)) + ')'}")
        return hints(inner)[part]
    origin = typing.get_origin(inner)
    if origin is dict:
        if node is not None and part not in node:
            entries = ", ".join(map(str, node)) or "none"
            raise SchemaError(f"{path} has no entry {part!r}{nearest(part, node)} (entries: {entries}); "
                              f"to add one, write +{path}.{part}=...")
        return typing.get_args(inner)[1]
    if origin is list:
        if not part.isdigit() or (node is not None and int(part) >= len(node)):
            raise SchemaError(f"{path} has {len(node) if node is not None else 0} entries; {part!r} is not one of them")
        return typing.get_args(inner)[0]
    raise SchemaError(f"{path} is {describe(kind)} and has no field {part!r}")


def bounds(kind) -> str:
    """A numeric field's range as a user reads it: '>= 1', '> 0', 'in (0, 1]'; '' if none."""
    kind = strip_annotated_optional(kind)
    if typing.get_origin(kind) is not typing.Annotated:
        return ""
    metas = [m for m in typing.get_args(kind)[1:] if isinstance(m, msgspec.Meta)]
    low = high = None
    for meta in metas:
        if meta.ge is not None:
            low = ("[", meta.ge)
        if meta.gt is not None:
            low = ("(", meta.gt)
        if meta.le is not None:
            high = ("]", meta.le)
        if meta.lt is not None:
            high = (")", meta.lt)
    if low and high:
        return f"in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]:g}"
    return ""


def strip_annotated_optional(kind):
    """`Annotated[T, ...] | None` -> `Annotated[T, ...]` (the range kept)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def describe(kind) -> str:
    """A type as a user reads it: 'an integer >= 1', 'one of a, b', 'a number or null', ..."""
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    inner = bare(kind)
    optional = typing.get_origin(strip_annotated(kind)) in (typing.Union, types.UnionType) and \
        type(None) in typing.get_args(strip_annotated(kind)) and variants(kind) is None
    suffix = " or null" if optional else ""
    if typing.get_origin(inner) is typing.Literal:
        return "one of " + ", ".join(repr(a) if a == "" else str(a) for a in typing.get_args(inner)) + suffix
    if inner in names:
        span = bounds(kind)
        return names[inner] + (f" {span}" if span else "") + suffix
    union = variants(kind)
    if union is not None:
        return f"a mapping with {tag_field(union)}: {' | '.join(union)}"
    if is_section(inner):
        return f"a mapping of {inner.__name__} fields ({', '.join(hints(inner))})" + suffix
    origin = typing.get_origin(inner)
    if origin is list:
        return f"a list of {describe(typing.get_args(inner)[0])}" + suffix
    if origin is dict:
        return f"a mapping to {describe(typing.get_args(inner)[1])}" + suffix
    return str(inner) + suffix


def value_error(path: str, kind, value) -> str | None:
    """Why `value` does not fit field `path` of type `kind` (None if it does)."""
    try:
        msgspec.convert(value, kind)
        return None
    except msgspec.ValidationError as exc:
        detail = str(exc)
    inner = bare(kind)
    if inner in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool) and bounds(kind):
        if inner is float or isinstance(value, int):
            return f"{path}={value} is out of range: it must be {bounds(kind)}"
    if typing.get_origin(inner) is typing.Literal and isinstance(value, str):
        return f"{path}={value}: must be {describe(kind)}{nearest(value, typing.get_args(inner))}"
    if typing.get_origin(inner) is list and isinstance(value, list):
        entry = bare(typing.get_args(inner)[0])
        bad = [v for v in value if typing.get_origin(entry) is typing.Literal and value_error(path, entry, v)]
        if bad:  # a list of names (`trainer.loggers`): the name it does not know, and the nearest
            return f"{path}: {bad[0]!r} is not {describe(entry)}{nearest(str(bad[0]), typing.get_args(entry))}"
    structured = is_section(inner) or variants(kind) is not None or typing.get_origin(inner) in (dict, list)
    if structured and isinstance(value, (dict, list)):
        return f"{path}: {detail.replace('$.', path + '.').replace(' - at `$`', '')}"
    shown = value if not isinstance(value, str) else repr(value)
    return f"{path} expects {describe(kind)}, got {shown}"


class Leaf(msgspec.Struct, frozen=True):
    """A field of the schema as `--help` and the hints list it."""

    path: str  # dotted, as an override names it: "policy.loss.clip_high", "reward.endpoints.<name>.kind"
    kind: object  # its type, range kept
    owner: type  # the section that declares it
    name: str  # its name there
    variant: str = ""  # "type=gae" for a field of one variant of a union


def leaves(cls: type, prefix: str = "", variant: str = "") -> list[Leaf]:
    """Every leaf field under section `cls`, depth first in declaration order: a section's fields
    follow under its name, a union's variants each list their own (with their tag), a mapping or
    list of sections lists its entries' fields (`.<name>`, `[i]`)."""
    out = []
    for name, kind in hints(cls).items():
        path = prefix + name
        union = variants(kind)
        inner = bare(kind)
        if union is not None:
            out.append(Leaf(path + "." + tag_field(union), typing.Literal[tuple(union)], cls, name, variant))
            for tag, member in union.items():
                out += [leaf for leaf in leaves(member, path + ".", f"{tag_field(union)}={tag}")]
        elif is_section(inner):
            out += leaves(inner, path + ".", variant)
        else:
            out.append(Leaf(path, kind, cls, name, variant))
            entry = _entry_of(inner)
            if entry is not None:
                suffix, entry_kind = entry
                entry_union = variants(entry_kind)
                if entry_union is not None:
                    key = tag_field(entry_union)
                    out.append(Leaf(path + suffix + "." + key, typing.Literal[tuple(entry_union)], cls, name, variant))
                    for tag, member in entry_union.items():
                        out += leaves(member, path + suffix + ".", f"{key}={tag}")
                else:
                    out += leaves(bare(entry_kind), path + suffix + ".", variant)
    return out


def _entry_of(kind):
    """`dict[str, S]` -> (".<name>", S), `list[S]` -> ("[i]", S) for a section or a union of them."""
    args = typing.get_args(kind)
    origin = typing.get_origin(kind)
    candidates = {dict: (".<name>", args[-1] if args else None), list: ("[i]", args[0] if args else None)}
    if origin in candidates:
        suffix, entry = candidates[origin]
        if entry is not None and (is_section(entry) or variants(entry) is not None):
            return suffix, entry
    return None


def elsewhere(root: type, name: str, cutoff: float = 0.75) -> str:
    """`algorithm.clip_hgh`: the fields of that name (or near it) anywhere in the schema, as a hint."""
    paths = {}
    for leaf in leaves(root):
        paths.setdefault(leaf.name, []).append(leaf.path + (f" ({leaf.variant})" if leaf.variant else ""))
    close = difflib.get_close_matches(name, sorted(paths), n=1, cutoff=cutoff)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(p) for p in paths[close[0]][:3]) + "?"


def conversion_message(root: type, data: dict, detail: str) -> str:
    """msgspec's error converting `data` to `root` (`... - at $.a.b`) as one line naming the field,
    with the field's own words."""
    match = re.search(r" - at `\$\.?([^`]*)`", detail)
    where = match.group(1) if match else ""
    parts = [p for p in re.split(r"\.|\[(\d+|\.\.\.)\]", where) if p]
    node, kind, path = data, root, ""
    try:
        for part in parts:
            if part == "...":  # msgspec does not name the mapping's key: the first entry that fails
                part = _failing_entry(node, child(kind, node, next(iter(node), ""), path))
            kind = child(kind, node, part, path)
            node = node[int(part)] if isinstance(node, list) else node[part]
            path = f"{path}.{part}" if path else part
    except (SchemaError, KeyError, IndexError, TypeError) as exc:
        return f"invalid config: {exc if isinstance(exc, SchemaError) else detail}"
    unknown = re.match(r"Object contains unknown field `([^`]+)`", detail)
    if unknown:
        try:
            child(kind, node, unknown.group(1), path)
        except SchemaError as exc:
            return str(exc)
    missing = re.match(r"Object missing required field `([^`]+)`", detail)
    if missing:
        return f"{path}.{missing.group(1)} is required"
    return value_error(path, kind, node) or f"invalid config: {detail}"


def _failing_entry(mapping: dict, entry_type) -> str:
    for key, value in mapping.items():
        try:
            msgspec.convert(value, entry_type)
        except msgspec.ValidationError:
            return key
    return next(iter(mapping))
