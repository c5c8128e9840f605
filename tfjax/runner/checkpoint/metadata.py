"""What a step records about itself, and the check that it still has every item.

Every step directory records, in Orbax's `_CHECKPOINT_METADATA` (JSON), the items it was written
with, tfjax's checkpoint FORMAT, and the versions of jax, flax, optax, orbax and tfjax that wrote
it; restoring under other versions logs a warning with both lists. A step that lacks an item it
was written with is damaged, not old: `_check_items` refuses it before anything is read.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json

from absl import logging

from tfjax.runner.checkpoint.errors import UnusableCheckpointError
from tfjax.runner.checkpoint.paths import _is_dir, _read_json, _step_dir

VERSIONED = ("jax", "flax", "optax", "orbax-checkpoint", "tfjax")
# The format of the steps this tfjax writes, recorded in their metadata ("tfjax_format"). 2:
# data positions name their step. Steps without it were written before: their positions are
# not bound to a step, and they may lack the checksums item.
FORMAT = 2


@functools.cache  # read once per process: every save records them
def versions() -> dict[str, str]:
    """{"jax": "0.x", ...}: the versions of the packages a checkpoint's contents depend on."""
    out = {}
    for package in VERSIONED:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:  # e.g. tfjax run from a checkout
            out[package] = "unknown"
    if out["tfjax"] == "unknown":
        import tfjax

        out["tfjax"] = tfjax.__version__
    return out


def _custom_metadata(manager, step: int) -> dict:
    """The custom metadata of a step, read from its JSON file alone (Orbax's `metadata(step)`
    also opens every array, which fails on a damaged step before it says anything useful)."""
    path = _step_dir(manager, step) / "_CHECKPOINT_METADATA"
    return json.loads(path.read_text()).get("custom_metadata") or {}


def check_versions(manager, step: int) -> None:
    """Warns (naming both lists) when the checkpoint was written under other package versions."""
    try:
        stored = _custom_metadata(manager, step).get("versions")
    except Exception as e:  # noqa: BLE001 - metadata is advisory, never a reason to fail
        logging.warning(
            "Checkpoint %s/%d: cannot read its metadata (%s)", manager.directory, step, e
        )
        return
    current = versions()
    if stored is None:
        logging.warning(
            "Checkpoint %s/%d records no package versions (written before tfjax recorded "
            "them); restoring under %s",
            manager.directory,
            step,
            current,
        )
    elif stored != current:
        logging.warning(
            "Checkpoint %s/%d was written under other package versions: checkpoint %s, now %s. "
            "Restoring anyway; if values or shapes look wrong, use the versions it was written "
            "with.",
            manager.directory,
            step,
            stored,
            current,
        )


def _items_written(metadata: dict, root) -> set[str]:
    """The items a step was written with, as Orbax records them in its _CHECKPOINT_METADATA
    (versions of Orbax that did not record them: the item directories it has)."""
    handlers = metadata.get("item_handlers")
    if isinstance(handlers, dict):
        return set(handlers)
    return {"params", "state"} | {item for item in ("data", "checksums") if _is_dir(root / item)}


def _check_items(manager, step: int, items) -> dict:
    """The step's _CHECKPOINT_METADATA, after naming what a read would miss: a metadata file
    missing or unparsable, or an item (of `items`, or any other the step was written with: a
    step that lacks one is damaged, not old) missing."""
    root = _step_dir(manager, step)
    metadata = _read_json(root / "_CHECKPOINT_METADATA")
    if not isinstance(metadata, dict):
        raise UnusableCheckpointError(f"{root / '_CHECKPOINT_METADATA'}: damaged (not an object)")
    for item in sorted(set(items) | _items_written(metadata, root)):
        if not _is_dir(root / item):
            raise UnusableCheckpointError(f"{root / item}: missing (the step lacks its {item})")
        if item in ("params", "state"):
            _read_json(root / item / "_METADATA")
    return metadata
