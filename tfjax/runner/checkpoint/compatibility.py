"""Whether a checkpoint fits the run: the shapes it stores against the model's.

They are compared before anything is restored; a mismatch is a CheckpointMismatchError naming
the first differing parameter or state array, and nothing is restored or deleted.
"""

from __future__ import annotations

import jax

from tfjax.runner.checkpoint.errors import (
    CheckpointMismatchError,
    UnusableCheckpointError,
    _short,
)


def _path_str(path) -> str:
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def _shapes(tree) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path_str(path): tuple(leaf.shape) for path, leaf in leaves if leaf is not None}


def stored_param_shapes(manager, step: int) -> dict[str, tuple]:
    """{"encoder/layers_0/mlp/wi/kernel": shape} of the parameters saved at `step`."""
    return _stored_shapes(manager, step, "params")["params"]


def _stored_shapes(manager, step: int, *items: str) -> dict[str, dict[str, tuple]]:
    """{item: {path: shape}} of the step's `items`, from one read of its metadata (Orbax reads
    every item's tree each time it is asked, a tenth of a second for a small model's state)."""
    try:
        metadata = manager.item_metadata(step)
        trees = {item: metadata[item] for item in items}
    except Exception as e:  # noqa: BLE001 - any failure to read metadata makes the step unusable
        raise UnusableCheckpointError(
            f"{manager.directory}/{step}: the metadata of its {' and '.join(items)} cannot be "
            f"read ({_short(e)})"
        ) from e
    return {item: _shapes(getattr(tree, "tree", tree)) for item, tree in trees.items()}


def check_params_fit(stored: dict[str, tuple], abstract_params, where: str) -> None:
    """Raises CheckpointMismatchError naming the first parameter whose path or shape differs."""
    _check_fit(
        stored, abstract_params, where, "parameter", "the config the checkpoint was written with"
    )


def _check_fit(stored: dict[str, tuple], abstract, where: str, what: str, hint: str) -> None:
    wanted = _shapes(abstract)
    problems = []
    for name in sorted(wanted.keys() | stored.keys()):
        if name not in stored:
            problems.append(f"{what} {name!r} {wanted[name]} of the model is not in it")
        elif name not in wanted:
            problems.append(f"its {what} {name!r} {stored[name]} is not in the model")
        elif stored[name] != wanted[name]:
            problems.append(
                f"{what} {name!r} has shape {stored[name]} there but {wanted[name]} in the model"
            )
    if problems:
        raise CheckpointMismatchError(
            f"the checkpoint {where} does not fit this run: {problems[0]}"
            + (f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else "")
            + f". Nothing was restored or deleted; use another workdir or {hint}."
        )
