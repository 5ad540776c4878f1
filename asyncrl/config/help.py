"""`asyncrl train --help`'s list of settings: the config groups and their options, then every field of
the schema (`Config`, walked by `asyncrl.config.schema.leaves`) with its type and range, its value
in the default config, and its docstring.

A field's docstring is the string literal right under it in the class body (as in PEP 257's
attribute docstrings); Python keeps no trace of it at runtime, so it is read from the source with
`ast`. Everything comes from the schema itself, so the help cannot drift from it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache

import msgspec

from asyncrl.config import Config, config_groups, schema

MAX_DEFAULT_CHARS = 60


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> docstring (whitespace as written, indentation removed) of a section, its bases' too."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not isinstance(klass, type) or klass.__module__ in ("builtins", "msgspec"):
            continue
        try:
            (node,) = ast.parse(textwrap.dedent(inspect.getsource(klass))).body
        except (OSError, TypeError):
            continue
        for stmt, after in zip(node.body, node.body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def one_line(doc: str) -> str:
    """A docstring's first line; ' …' where more follows (`docs/` and the source have the rest)."""
    lines = doc.strip().splitlines()
    return lines[0] + (" …" if len(lines) > 1 else "") if lines else ""


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= MAX_DEFAULT_CHARS else text[: MAX_DEFAULT_CHARS - 1] + "…"


def _value_at(data, path: str):
    """The value of a dotted leaf in the composed defaults (None where the path has no one value:
    a mapping's entries, another variant of a union)."""
    node = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def config_help(defaults: Config | None = None) -> str:
    """The text `asyncrl train --help` prints after its usage line."""
    lines = ["config groups (group=option picks configs/<group>/<option>.yaml, e.g. algorithm=grpo):"]
    groups = config_groups()
    width = max(map(len, groups), default=0)
    lines += [f"  {group:<{width}}  {', '.join(options)}" for group, options in sorted(groups.items())]
    lines += ["", "fields (section.field=value; a wrong name, type or range fails at start-up naming the field;",
              "+section.mapping.<key>={...} adds an entry; a union's fields follow their `type=`/`kind=`;",
              "shown: type = value in the default config):"]
    data = msgspec.to_builtins(defaults) if defaults is not None else {}
    section = None
    for leaf in schema.leaves(Config):
        head = leaf.path.split(".", 1)[0] if "." in leaf.path else ""
        if head != section:
            section = head
            lines += ["", f"[{head}]" if head else "[top level]"]
        value = _value_at(data, leaf.path)
        shown = f" = {_shown(value)}" if value is not None or (defaults is not None and "<" not in leaf.path
                                                              and "[" not in leaf.path and not leaf.variant) else ""
        where = f"  ({leaf.variant})" if leaf.variant else ""
        lines.append(f"  {leaf.path}: {schema.describe(leaf.kind)}{shown}{where}")
        doc = field_docs(leaf.owner).get(leaf.name, "")
        if doc:
            lines.append(f"      {one_line(doc)}")
    lines += ["", "More: README.md (commands, algorithms, rewards), docs/architecture.md (what each setting "
                  "drives), docs/ (results, benchmarks, reliability, GPU); each field's whole docstring is in "
                  "the schema (module asyncrl.config)."]
    return "\n".join(lines)
