"""The checkpoints directory on disk: its step entries, TRASH, the steps set aside, its files.

`<workdir>/checkpoints/<step>/` is a step directory (Orbax's names). Orbax deletes an old step by
renaming it, atomically, into `checkpoints/TRASH/` first (an interrupted rmtree would leave a
listed but partial step), and `empty_trash` removes it from there. A resumed run moves the steps
it passed over into `<workdir>/checkpoints_set_aside/` (resume.set_aside_after).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading

import jax
from etils import epath

from tfjax.runner.checkpoint.errors import UnusableCheckpointError, _permission_errors

TRASH = "TRASH"  # old steps are renamed into this subdirectory, then removed from there
UNUSABLE = "checkpoints_set_aside"  # beside checkpoints/: steps a resumed run moved away


def _step_dir(manager, step: int) -> epath.Path:
    return epath.Path(manager.directory) / str(step)


def _step_entries(manager) -> dict[int, str]:
    """{step: path} of every entry of the checkpoints directory named as a step, whether Orbax
    lists it or not."""
    directory = os.fspath(manager.directory)
    with _permission_errors(directory):
        names = os.listdir(directory)
    return {int(n): os.path.join(directory, n) for n in names if n.isascii() and n.isdigit()}


def checkpoints_dir(path: str) -> str:
    """A run's workdir or its checkpoints directory -> the checkpoints directory."""
    path = os.path.abspath(os.path.expanduser(path))
    sub = os.path.join(path, "checkpoints")
    return sub if os.path.isdir(sub) else path


def has_checkpoint(path: str) -> bool:
    """A run's workdir, or its checkpoints directory, holds a step directory (Orbax's names)."""
    directory = checkpoints_dir(path)
    return os.path.isdir(directory) and any(
        name.isdigit() and os.path.isdir(os.path.join(directory, name))
        for name in os.listdir(directory)
    )


def empty_trash(directory, *, background: bool = False) -> None:
    """Removes the old steps renamed into `<directory>/TRASH/` (primary process only).

    Only entries present now are removed, and never TRASH itself, so a deletion that Orbax's
    background thread is renaming in at this moment is left for the next call. background:
    remove them in a daemon thread, so that the training loop does not wait for the file
    system; what a process exit interrupts is removed when the next manager is made.
    """
    if jax.process_index() != 0:
        return
    trash = os.path.join(os.fspath(directory), TRASH)
    if not os.path.isdir(trash):
        return
    paths = [os.path.join(trash, name) for name in os.listdir(trash)]

    def remove():
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)

    if background and paths:
        threading.Thread(target=remove, name="tfjax-empty-trash", daemon=True).start()
    else:
        remove()


def _is_dir(path) -> bool:
    """Whether `path` is a directory; unlike Path.is_dir, a directory this process may not
    search raises PermissionError instead of looking absent."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _read_json(path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UnusableCheckpointError(f"{path}: missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise UnusableCheckpointError(f"{path}: not valid JSON ({e})") from None
