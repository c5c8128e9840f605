"""A family's load and save: checkpoint -> (tfjax model, params) by its config table and key
rules, and back.

`from_hf` reads the config through the family's table (`tables.build`) and the weights through
its rules (`import_params`); `to_hf` writes both back. `converters` makes the public pair
`from_x` / `to_x` of a family that needs nothing else, `exporter` the export of a module whose
families a model chooses among (Llama, Mistral, Qwen).
"""

import fnmatch
import logging
from collections.abc import Callable, Iterator

import numpy as np

from tfjax.interop.core.files import StateDict, load_source
from tfjax.interop.core.rules import (
    check_state,
    convert_rules,
    export_state,
    finish,
    import_state,
    param_shapes,
    unrolled,
)
from tfjax.interop.core.tables import Family, build, hf_config
from tfjax.nn import scanned_path


def key_prefix(family: Family, state: StateDict) -> str:
    """The family's prefix, or "" for a bare base model's state dict (GPT2Model's "h.0...")."""
    if family.bare and not any(k.startswith(family.prefix) for k in state):
        if any(k.startswith(family.bare) for k in state):
            return ""
    return family.prefix


def import_rules(family: Family, model, state: StateDict, prefix: str):
    """The family's key rules for reading `state`, in the layout its keys have."""
    return family.rules(model, prefix, **family.layout(state))


def ignored(family: Family, state: StateDict) -> tuple[str, ...]:
    """The patterns of the keys reading `state` leaves alone: the family's buffers and the
    parts it skips, of which a log line says how many tensors `state` holds (keys only)."""
    if family.skip:
        counts = {p: sum(fnmatch.fnmatch(k, p) for k in state) for p in family.skip}
        found = {p: n for p, n in counts.items() if n}
        if found:
            logging.getLogger(__name__).info(
                "%s: skipped %d tensors tfjax does not load: %s",
                family.architecture,
                sum(found.values()),
                ", ".join(f"{p} ({n})" for p, n in found.items()),
            )
    return (*family.ignore, *family.skip)


def import_params(family: Family, model, state: StateDict, *, inputs=None, rules=None):
    """`model`'s params from `state` by the family's rules (or `rules`), every key checked, in
    the model's layout. `inputs` replace the family's example inputs (ViT's image size)."""
    prefix = key_prefix(family, state)
    params = import_state(
        state,
        import_rules(family, model, state, prefix) if rules is None else rules,
        param_shapes(model, *(family.inputs if inputs is None else inputs)),
        what=family.architecture,
        ignore=ignored(family, state),
        tied=family.tied(model, prefix),
    )
    return finish(model, params)


def check_params(family: Family, model, state: StateDict):
    """(rules, expected param shapes) of importing `state` into `model`, every key and shape
    checked first (from the headers of a LazyStateDict: no tensor is read); a ValueError names
    the key, its file and both shapes."""
    prefix = key_prefix(family, state)
    rules = import_rules(family, model, state, prefix)
    expected = param_shapes(model, *family.inputs)
    check_state(
        state,
        rules,
        expected,
        what=family.architecture,
        ignore=ignored(family, state),
        tied=family.tied(model, prefix),
    )
    return rules, expected


def stream_params(family: Family, model, state: StateDict) -> Iterator[tuple[tuple, np.ndarray]]:
    """`import_params` one parameter at a time: (path in `model`'s layout, numpy array), every
    key and shape checked before the first is read (from the headers of a LazyStateDict). A
    scanned model's stacked parameter is filled layer by layer and given when complete, the
    rules ordered so that one stacked parameter is being filled at a time: the caller can place
    each array and drop it, holding at most one parameter of the model on the host."""
    rules, expected = check_params(family, model, state)
    if not getattr(model, "scan_layers", False):
        yield from convert_rules(state, rules, expected)
        return

    def order(rule):  # a stacked parameter's layers one after another
        where = [scanned_path(p) for p in rule.paths]
        return [p for p, _ in where], max(layer if layer is not None else -1 for _, layer in where)

    rules = sorted(rules, key=order)
    depth = {}  # stacked path -> number of layers
    for rule in rules:
        for path in rule.paths:
            stacked, layer = scanned_path(path)
            if layer is not None:
                depth[stacked] = depth.get(stacked, 0) + 1
    filling, filled = {}, {}
    for path, array in convert_rules(state, rules, expected):
        stacked, layer = scanned_path(path)
        if layer is None:
            yield path, array
            continue
        if stacked not in filling:
            filling[stacked] = np.empty((depth[stacked], *array.shape), array.dtype)
            filled[stacked] = 0
        filling[stacked][layer] = array
        filled[stacked] += 1
        if filled[stacked] == depth[stacked]:
            yield stacked, filling.pop(stacked)


def from_hf(family: Family, source, config=None, **overrides):
    """(tfjax model, params) from a checkpoint directory or (state dict, config)."""
    state, c = load_source(source, config)
    model = build(family, c, **overrides)
    return model, import_params(family, model, state)


def to_hf(family: Family, model, params, *, rules=None):
    """({Hugging Face key: numpy array}, config dict) for a tfjax model of the family."""
    config = hf_config(family, model)
    rules = family.rules(model, family.prefix) if rules is None else rules
    return export_state(unrolled(model, params), rules), config


def exporter(family: Callable, written: Callable = lambda model: model) -> Callable:
    """An export (model, params) -> `to_hf` of the family `family(model)` chooses (a module
    of several families), writing `written(model)`."""

    def export(model, params):
        return to_hf(family(model), written(model), params)

    return export


def converters(family: Family, name: str, written: Callable = lambda model: model):
    """`from_<name>(source, config=None, **overrides)` and `to_<name>(model, params)` of a
    family whose load and save are its table's and rules' alone; `written(model)` is the model
    the export writes (its None sizes spelled out)."""

    def load(source, config=None, **overrides):
        return from_hf(family, source, config, **overrides)

    def save(model, params):
        return to_hf(family, written(model), params)

    what = family.architecture
    load.__doc__ = (
        f"(tfjax model, params) from a {what} checkpoint directory or (state dict, config).\n\n"
        "`overrides` set model fields (scan_layers=True, dtype, implementation, ...)."
    )
    save.__doc__ = f"({{Hugging Face key: numpy array}}, config dict) of a {what} for a model."
    for fn, verb in ((load, "from"), (save, "to")):
        fn.__name__ = fn.__qualname__ = f"{verb}_{name}"
    load.family = family  # the runner builds the model from the config before reading weights
    return load, save
