"""`asyncrl train --help`'s list of settings: the config groups and their options, then every field of
the schema (`Config`, walked with `dataclasses.fields`) with its type, default and docstring.

A field's docstring is the string literal right under it in the class body (as in PEP 257's
attribute docstrings); Python keeps no trace of it at runtime, so it is read from the source with
`ast`. Everything comes from the schema itself, so the help cannot drift from it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import cache

from asyncrl.config import Config, config_groups

MAX_DEFAULT_CHARS = 60


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> docstring (whitespace as written, indentation removed) of a dataclass."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    docs = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def one_line(doc: str) -> str:
    """A docstring's first line; ' …' where more follows (`docs/` and the source have the rest)."""
    lines = doc.strip().splitlines()
    return lines[0] + (" …" if len(lines) > 1 else "") if lines else ""


@dataclasses.dataclass(frozen=True)
class FieldHelp:
    path: str  # dotted, as an override names it: "algorithm.clip_high", "reward.endpoints.<name>.kind"
    type: str  # as annotated in the schema
    default: str  # repr of the value in `defaults` (empty for entries of a mapping or list)
    doc: str  # the whole docstring ("" if none)


def _entry_class(hint) -> tuple[str, type] | None:
    """`dict[str, D]` -> (".<name>", D), `list[D]` -> ("[i]", D) for a dataclass D; else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return ".<name>", args[1]
    if typing.get_origin(hint) is list and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return "[i]", args[0]
    return None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= MAX_DEFAULT_CHARS else text[: MAX_DEFAULT_CHARS - 1] + "…"


def walk(cls: type = Config, defaults=None, prefix: str = "") -> list[FieldHelp]:
    """Every leaf field under `cls`, depth first in declaration order. A field that is a dataclass
    is a section (its fields follow under its name); a mapping or list of dataclasses lists its
    entries' fields too. `defaults`: an instance of `cls` whose values are shown (e.g. the composed
    default config); None = the dataclass defaults."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        path, hint = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += walk(hint, getattr(defaults, f.name) if defaults is not None else None, path + ".")
            continue
        if defaults is not None:
            value = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()
        annotation = f.type if isinstance(f.type, str) else getattr(hint, "__name__", str(hint))
        out.append(FieldHelp(path, annotation, _shown(value), docs.get(f.name, "")))
        entry = _entry_class(hint)
        if entry is not None:
            suffix, entry_cls = entry
            out += [dataclasses.replace(item, default="") for item in walk(entry_cls, None, path + suffix + ".")]
    return out


def config_help(defaults: Config | None = None) -> str:
    """The text `asyncrl train --help` prints after its usage line."""
    lines = ["config groups (group=option picks configs/<group>/<option>.yaml, e.g. algorithm=grpo):"]
    groups = config_groups()
    width = max(map(len, groups), default=0)
    lines += [f"  {group:<{width}}  {', '.join(options)}" for group, options in sorted(groups.items())]
    lines += ["", "fields (section.field=value; a wrong name or type fails at start-up naming the field;",
              "+section.mapping.<key>={...} adds an entry; shown: type = value in the default config):"]
    section = None
    for item in walk(Config, defaults):
        head = item.path.split(".", 1)[0] if "." in item.path else ""
        if head != section:
            section = head
            lines += ["", f"[{head}]" if head else "[top level]"]
        value = f" = {item.default}" if item.default else ""
        lines.append(f"  {item.path}: {item.type}{value}")
        if item.doc:
            lines.append(f"      {one_line(item.doc)}")
    lines += ["", "More: README.md (commands, algorithms, rewards), docs/architecture.md (what each setting "
                  "drives), docs/ (results, benchmarks, reliability, GPU); each field's whole docstring is in "
                  "the schema (module asyncrl.config)."]
    return "\n".join(lines)
