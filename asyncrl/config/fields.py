"""The building blocks of the typed config, written once: a `Section` (typed fields, each with its
docstring, unknown keys refused), the `Variant` of a tagged union (its tag says which one), and the
numeric ranges fields carry. msgspec checks all of it when a config is converted: the range or the
allowed names of a field live on the field itself, nowhere else.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

# Ranges, as field types (msgspec.Meta checks them on conversion; `asyncrl train --help` shows them).
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
UnitFloat = Annotated[float, msgspec.Meta(ge=0, le=1)]
"""A fraction or probability, in [0, 1]."""
NO_BOUND = 1 << 30
"""A count with no bound (a staleness or budget that is never reached), where an int is needed."""


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A config section: typed fields with defaults, a docstring under each; unknown keys are refused."""


class Variant(Section, tag_field="type"):
    """One variant of a union keyed on `type` (e.g. `algorithm.advantage`): its own fields only."""

    @property
    def type(self) -> str:
        return type(self).__struct_config__.tag


class KindVariant(Section, tag_field="kind"):
    """One variant of a union keyed on `kind` (a reward endpoint): its own fields only."""

    @property
    def kind(self) -> str:
        return type(self).__struct_config__.tag


def tag_of(variant_class: type) -> str:
    """The tag a variant class is written with (`type: gae`, `kind: verifier`)."""
    return variant_class.__struct_config__.tag


def tag_field_of(variant_class: type) -> str:
    return variant_class.__struct_config__.tag_field


def replaced(struct, changes: dict[str, object]):
    """A copy of `struct` with nested fields changed by dotted path, e.g.
    `replaced(objective, {"policy.compute.precision": "bf16"})`; the rest is shared."""
    out = struct
    for path, value in changes.items():
        out = _replace_path(out, path.split("."), value)
    return out


def _replace_path(struct, parts: list[str], value):
    head, rest = parts[0], parts[1:]
    inner = value if not rest else _replace_path(getattr(struct, head), rest, value)
    return msgspec.structs.replace(struct, **{head: inner})
