"""Who owns a workdir, and what its config was: the run lock and the config history.

One workdir is one run. `claim(workdir)` takes `WORKDIR/run.lock` for as long as the run
lives, before any process writes anything there; a second run on the same workdir (on this
host or, through a shared file system's locks, on another) refuses at start, naming the owner
(host, pid, start time, command). The lock is the operating system's (`flock`): a killed
run's lock ends with its process, so a relaunch is never blocked by a dead owner and never
has to guess from the lock's age. On many processes only process 0 locks, and the others
learn the outcome before they go on. The lock file itself is never deleted (deleting a lock
file that another process has open would let two runs hold "the" lock); it names the owner
while a run lives and is emptied when it ends, so the next run can say that the previous one
was killed.

`record_config(workdir, config, step)` writes `config.json`; when a resumed run's config
differs from the stored one, it logs each changed field and keeps the earlier file as
`config.<step>.json` (the step the change takes effect at).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
import sys

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.json"


class WorkdirBusyError(RuntimeError):
    """Another live run owns the workdir."""


def _owner_text() -> str:
    return json.dumps(
        {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
    )


def _describe(text: str) -> str:
    try:
        o = json.loads(text)
        return f"pid {o['pid']} on host {o['host']}, started {o['started']}: {o['command']}"
    except (ValueError, KeyError, TypeError):  # written this instant, or by hand
        return "an owner that has not written its name yet"


def _lock(workdir: str):
    """The open, locked lock file of `workdir` (created with the workdir when missing)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    f = open(path, "a+")  # noqa: SIM115 - held open for the run's lifetime
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = _describe(f.read())
        f.close()
        raise WorkdirBusyError(
            f"workdir {workdir} is in use by another run ({owner}). Wait for it to end, stop "
            f"it, or use another --workdir. (The lock is {path}; it ends with its process.)"
        ) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        logging.warning(
            "The file system of %s cannot lock files (%s): nothing stops a second "
            "run on this workdir.",
            workdir,
            e.strerror,
        )
    f.seek(0)
    previous = f.read()
    if previous:  # a run that ends, however it fails, empties the file
        logging.warning(
            "Workdir %s: the run that owned it before did not end cleanly (killed?): "
            "%s. Taking it over.",
            workdir,
            _describe(previous),
        )
    f.seek(0)
    f.truncate()
    f.write(_owner_text() + "\n")
    f.flush()
    return f


class Claim:
    """What `claim` yields: the run calls `started()` before its first training step."""

    def __init__(self):
        self.has_started = False

    def started(self) -> None:
        self.has_started = True


@contextlib.contextmanager
def claim(workdir: str):
    """Holds the workdir's lock (process 0) while the block runs; see the module docstring.
    Yields a `Claim`.

    If the block fails before the run started training (`Claim.started`: set-up, loading, the
    step-0 evaluation) and this run created the workdir, the workdir is removed: a failed start
    leaves nothing behind, so the rerun after a fix starts as new. A workdir that existed is
    never touched, and a run that failed after starting keeps its logs and checkpoints.
    """
    created = not os.path.exists(workdir)
    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = _lock(workdir)
        except (WorkdirBusyError, OSError) as e:
            error = e
    if jax.process_count() > 1:  # every process learns whether process 0 holds the lock
        got = multihost_utils.process_allgather(np.int32(error is None))
        if error is None and not got[0]:
            raise WorkdirBusyError(
                f"process 0 could not take the lock of workdir {workdir}; its error says why"
            )
    if error is not None:
        raise error
    ok, run = False, Claim()
    try:
        yield run
        ok = True
    finally:
        if lock is not None:
            lock.truncate(0)  # a clean end; a killed run leaves its name for the next one
            lock.close()  # releases the flock
        if created and not ok and not run.has_started and jax.process_index() == 0:
            shutil.rmtree(workdir, ignore_errors=True)


# ----------------------------------------------------------------------------- config history
def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(stored: dict, current: dict) -> list[str]:
    """["num_train_steps: 100 -> 200", ...]: the fields whose values differ."""
    a, b = _flat(stored), _flat(current)
    missing = object()
    return [
        f"{k}: {a.get(k, missing)!r} -> {b.get(k, missing)!r}".replace(repr(missing), "(none)")
        for k in sorted(a.keys() | b.keys())
        if a.get(k, missing) != b.get(k, missing)
    ]


def record_config(workdir: str, config, step: int | None) -> None:
    """Writes config.json (process 0). On a resume (`step` not None) with another config, logs
    what changed and keeps the earlier file as config.<step>.json."""
    if jax.process_index() != 0:
        return
    path = os.path.join(workdir, CONFIG_FILE)
    text = config.to_json(indent=2)
    if step is not None and os.path.exists(path):
        with open(path) as f:
            stored_text = f.read()
        try:
            changes = config_changes(json.loads(stored_text), json.loads(text))
        except ValueError:
            changes = ["(the stored config.json is not valid JSON)"]
        if changes:
            kept = os.path.join(workdir, f"config.{step}.json")
            with open(kept, "w") as f:
                f.write(stored_text)
            logging.warning(
                "Resuming %s at step %d with a changed config (the earlier one is kept as "
                "%s):\n  %s",
                workdir,
                step,
                kept,
                "\n  ".join(changes),
            )
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # a kill mid-write never leaves a truncated config.json


def previous_config(workdir: str) -> dict | None:
    """The config the workdir's last run started with (its config.json), as a dict; None when
    it has none or it is not valid JSON."""
    try:
        with open(os.path.join(workdir, CONFIG_FILE)) as f:
            stored = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    return stored if isinstance(stored, dict) else None


def read_config(workdir: str):
    """The config a run recorded in its config.json (as it was last run), as a ConfigDict: what
    tools that take only --workdir (experiments/export.py) read."""
    import ml_collections

    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"--workdir={workdir!r} has no {CONFIG_FILE}: is it a run's workdir?"
        )
    with open(path) as f:
        try:
            return ml_collections.ConfigDict(json.load(f))
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); was it edited by hand?") from None
