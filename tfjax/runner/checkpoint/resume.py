"""Which step a run resumes from: the newest that verifies, or config.checkpoint.restore_step.

`restore_newest` tries the newest step first; a step that fails verification or reading is
named with the file and the reason in a few lines, and the run resumes from the newest step
that verifies (restore_step picks one explicitly). An entry named as a step that Orbax does not
list (a dangling symbolic link, a file) is unusable too: the next save of that step would fail
on it. The unusable steps (and, with restore_step, newer ones) are then moved, files unchanged,
into `<workdir>/checkpoints_set_aside/` (`set_aside_after`), so that the resumed run's new steps
neither collide with them nor get deleted in their favour. A step this process may not read is
no damage: the run stops naming it (CheckpointPermissionError), moving nothing.
"""

from __future__ import annotations

import os

import jax
from absl import logging
from jax.experimental import multihost_utils

from tfjax.runner import workdirs
from tfjax.runner.checkpoint.errors import (
    CheckpointError,
    UnusableCheckpointError,
    _permission_errors,
)
from tfjax.runner.checkpoint.paths import UNUSABLE, _step_entries
from tfjax.runner.checkpoint.restoring import restore


def _unlisted(manager) -> dict[int, str]:
    """{step: what is wrong} of the entries named as a step that Orbax does not list (a
    dangling symbolic link, a file): never restorable, and the next save of that step would
    fail on them."""
    listed, out = set(manager.all_steps()), {}
    for step, path in _step_entries(manager).items():
        if step in listed:
            continue
        if os.path.islink(path) and not os.path.exists(path):
            why = f"a symbolic link to {os.readlink(path)}, which does not exist"
        elif not os.path.isdir(path):
            why = "a file, not a step directory"
        else:
            why = "a directory Orbax does not list as a step"
        out[step] = f"{path}: {why}"
    return out


def _no_such_step(step: int, directory, steps) -> str:
    return (
        f"checkpoint.restore_step={step}: {directory} has no such step (it has "
        f"{sorted(steps) or 'none'}); set one of them, or leave it unset to resume from the "
        "newest step"
    )


def restore_step_to_apply(config, workdir: str) -> int | None:
    """config.checkpoint.restore_step, or None where an earlier run of `workdir` applied it.

    restore_step takes effect in the run that sets it (or changes it): that run resumes from
    it and sets the newer steps aside. The workdir's config.json records the config each run
    started with, so running the same command again (as run.py says after a stop) resumes
    from the newest step instead of rolling the run back again.
    """
    step = config.checkpoint.get("restore_step")
    previous = workdirs.previous_config(workdir) or {}
    applied = (previous.get("checkpoint") or {}).get("restore_step")
    return None if step == applied else step


def check_restore_step(config, workdir: str) -> None:
    """Raises ValueError when config.checkpoint.restore_step, still to apply, names no step in
    `workdir`: a pre-start check."""
    step = restore_step_to_apply(config, workdir)
    if step is None:
        return
    directory = os.path.join(os.path.abspath(os.path.expanduser(workdir)), "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    steps = [int(n) for n in names if n.isascii() and n.isdigit()]
    if step not in steps:
        raise ValueError(_no_such_step(step, directory, steps))


def restore_newest(manager, *, restore_step: int | None = None, **restore_kwargs):
    """(step, restored) of the newest step that reads and verifies, or (None, None) when the
    directory has no step. A step that fails (entries named as a step that Orbax does not list
    among them) is logged (file and reason) and left on disk, and the next older one is tried;
    `restore_step` restores that step or raises. With no usable step, raises
    UnusableCheckpointError listing them all. `restore_kwargs` go to `restore`.

    Every process takes the same decision: a step that fails on one process fails on all.
    """
    unlisted = _unlisted(manager)
    steps = sorted({*manager.all_steps(), *unlisted}, reverse=True)
    if restore_step is not None:
        if restore_step not in steps:
            raise CheckpointError(_no_such_step(restore_step, manager.directory, steps))
        steps = [restore_step]
    failures = []
    for step in steps:
        restored, error = None, None
        try:
            if step in unlisted:
                raise UnusableCheckpointError(unlisted[step])
            restored = restore(manager, step, **restore_kwargs)
        except UnusableCheckpointError as e:  # others (a mismatch, a permission) stop the run
            error = e  # the same on every process (see restore)
        if error is None:
            if failures:
                logging.warning(
                    "Resuming from checkpoint %s/%d, the newest that verifies.",
                    manager.directory,
                    step,
                )
            return step, restored
        failures.append(str(error))
        if restore_step is not None:
            raise error
        logging.error(
            "Checkpoint unusable: %s. Its files are left as they are; trying an older step.", error
        )
    if failures:
        raise UnusableCheckpointError(
            f"no checkpoint in {manager.directory} can be restored, and nothing was deleted:\n  "
            + "\n  ".join(failures)
            + "\nMove them away to start over in this workdir, or use another workdir."
        )
    return None, None


def set_aside_after(manager, step: int) -> None:
    """Moves every entry named as a step after `step` (unusable or passed over by restore_step:
    listed steps, dangling links, files), unchanged, into `<workdir>/checkpoints_set_aside/`,
    out of the manager's listing: a run resumed from `step` then neither collides with their
    step numbers nor has its own new steps deleted in their favour (keep counts the newest)."""
    directory = os.fspath(manager.directory)
    aside = os.path.join(os.path.dirname(directory), UNUSABLE)
    if jax.process_index() == 0:
        for newer, path in sorted(_step_entries(manager).items()):
            if newer <= step:
                continue
            os.makedirs(aside, exist_ok=True)
            target, n = os.path.join(aside, str(newer)), 1
            while os.path.lexists(target):
                target, n = os.path.join(aside, f"{newer}.{n}"), n + 1
            with _permission_errors(directory):
                os.rename(path, target)
            logging.warning("Checkpoint step %d moved, files unchanged, to %s", newer, target)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("tfjax: checkpoints set aside")
    manager.reload()
