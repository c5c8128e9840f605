"""What a config field allows, declared as data beside the field, and the one check of it.

    ALLOWED = {"width": allowed.integer(1), "dropout_rate": allowed.FRACTION}
    allowed.check({"width": 0}, ALLOWED, owner="model.")
    # ValueError: model.width must be an integer >= 1, got 0

A number must be finite and an integer an int, never a bool: a comparison alone would let
NaN through (`nan < 0` is False) and True pass for 1. None is allowed only where a rule says
so (`optional`). Only the standard library is imported: the configs, the data catalog, the
models and the runner all declare their fields with it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping


@dataclasses.dataclass(frozen=True)
class Allowed:
    """A field's allowed values: `what` completes "<field> must be ...", `test` decides."""

    what: str
    test: Callable[[object], bool]

    def __call__(self, value) -> bool:
        return bool(self.test(value))


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _bounds(low, high, above, below) -> str:
    """The range as words: " >= 1", " in [0, 1)", "" (unbounded)."""
    lower = f"[{low}" if low is not None else f"({above}" if above is not None else None
    upper = f"{high}]" if high is not None else f"{below})" if below is not None else None
    if lower and upper:
        return f" in {lower}, {upper}"
    for bound, word in ((low, ">="), (above, ">"), (high, "<="), (below, "<")):
        if bound is not None:
            return f" {word} {bound}"
    return ""


def _within(value, low, high, above, below) -> bool:
    return (
        (low is None or value >= low)
        and (high is None or value <= high)
        and (above is None or value > above)
        and (below is None or value < below)
    )


def integer(low=None, high=None) -> Allowed:
    """An int (not a bool) in [low, high]; None: unbounded on that side."""
    return Allowed(
        f"an integer{_bounds(low, high, None, None)}",
        lambda v: _is_int(v) and _within(v, low, high, None, None),
    )


def number(low=None, high=None, *, above=None, below=None) -> Allowed:
    """A finite int or float (not a bool) >= low, <= high, > above, < below (each optional)."""
    bounds = _bounds(low, high, above, below)
    what = f"a number{bounds}" if " in " in bounds else f"a finite number{bounds}"
    return Allowed(what, lambda v: _is_number(v) and _within(v, low, high, above, below))


FRACTION = number(0, below=1)  # a rate or a probability that must leave something: [0, 1)
BOOLEAN = Allowed("True or False", lambda v: isinstance(v, bool))
TEXT = Allowed("a string", lambda v: isinstance(v, str))
NONE = Allowed("None", lambda v: v is None)


def one_of(*values) -> Allowed:
    """One of `values` (compared with ==, types included: 1 is not True)."""
    return Allowed(
        f"one of {values!r}", lambda v: any(type(v) is type(x) and v == x for x in values)
    )


def either(*rules: Allowed) -> Allowed:
    """What any of `rules` allows."""
    return Allowed(" or ".join(r.what for r in rules), lambda v: any(r(v) for r in rules))


def optional(rule: Allowed) -> Allowed:
    """None (a placeholder: the default) or what `rule` allows."""
    return either(rule, NONE)


def of_type(annotation) -> Allowed | None:
    """The values of a dataclass field's type annotation (int, float, bool, str, a class, a
    tuple, X | None), or None where it says nothing checkable (Any, a string annotation)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rules = [of_type(a) for a in args if a is not type(None)]
        if any(r is None for r in rules):
            return None
        return either(*rules, NONE) if type(None) in args else either(*rules)
    origin = typing.get_origin(annotation) or annotation
    if origin is bool:
        return BOOLEAN
    if origin is int:
        return integer()
    if origin is float:
        return number()
    if origin is str:
        return TEXT
    if isinstance(origin, type) and origin is not object:
        name = origin.__name__
        return Allowed(f"a {name}", lambda v: isinstance(v, origin))
    return None


def check(values: Mapping, rules: Mapping[str, Allowed], *, owner: str = "") -> None:
    """Raises ValueError for the first field of `values` that its rule refuses:
    "<owner><field> must be <what>, got <value>"; fields `values` lacks are not checked."""
    for field, rule in rules.items():
        if field in values and not rule(values[field]):
            raise ValueError(f"{owner}{field} must be {rule.what}, got {values[field]!r}")
