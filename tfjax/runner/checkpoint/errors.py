"""The errors of a run's checkpoints, and how Orbax's and tensorstore's failures become them.

A CheckpointError's message names the step or file and what to do: experiments/run.py prints it
alone. Orbax wraps a failed read or write in many lines that name no file: `_short` gives one
line of the innermost cause, `_disk_full` and `_denied` tell a full disk and a denied permission
from damage, and the log filters keep their tracebacks (hundreds of lines) out of the logs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging as std_logging
import os
import sys


class CheckpointError(Exception):
    """An error of a run's checkpoints whose message names the step or file and what to do:
    experiments/run.py prints it alone (status 1)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is readable but does not fit this run (another model, optimizer or data
    loader): a config error, so no older step is tried instead."""


class DamagedWeightsError(CheckpointError, ValueError):
    """The weights a run starts from (config.init_from) hold NaN or Inf values."""


class UnusableCheckpointError(CheckpointError, RuntimeError):
    """A checkpoint step cannot be read, lacks an item it was written with, or fails its
    checksums: the run passes it over."""


class CheckpointPermissionError(CheckpointError, PermissionError):
    """This process may not read a checkpoint: not damage, so nothing is passed over or
    moved; the user gives the permission back."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save could not be written (disk full, permissions)."""


def _chain(e: BaseException | None):
    """e, then the exception it was raised from (or during), and so on."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _short(e: BaseException, limit: int = 400) -> str:
    """One line of an exception, from the innermost cause (tensorstore's names the file;
    Orbax's wrappers around it run to many lines and name none)."""
    *_, e = _chain(e)
    text = " ".join(str(e).split()).split(" [tensorstore_spec=")[0]  # the spec is a page long
    return f"{type(e).__name__}: {text[:limit]}{' ...' if len(text) > limit else ''}"


def _disk_full(e: BaseException | None) -> bool:
    # tensorstore's errors carry only the text
    return any(
        (isinstance(x, OSError) and x.errno == errno.ENOSPC) or "No space left on device" in str(x)
        for x in _chain(e)
    )


def _denied(e: BaseException) -> bool:
    # tensorstore's errors carry only the text
    return any(isinstance(x, PermissionError) or "PERMISSION_DENIED" in str(x) for x in _chain(e))


@contextlib.contextmanager
def _permission_errors(path):
    """A read of `path` (a step, the checkpoints directory) that this process may not make
    becomes one CheckpointPermissionError: not damage, so no older step is tried instead."""
    try:
        yield
    except (OSError, UnusableCheckpointError) as e:
        if isinstance(e, CheckpointPermissionError) or not _denied(e):
            raise
        raise CheckpointPermissionError(
            f"{path}: permission denied ({_short(e, 200)}). Give this user read and write "
            f"access to it (e.g. chmod -R u+rwX {path}) or run as the user who wrote it, then "
            "run the same command again; nothing was moved or deleted."
        ) from None


# ------------------------------------------------------- Orbax's and tensorstore's failure noise
class _ShortDiskFullLogs(std_logging.Filter):
    """Orbax logs a failed background write from each of its threads with a full traceback (a
    full disk: ~500 lines). Those caused by a full disk keep one line each; the run's own error
    (CheckpointWriteError) says what to do."""

    def filter(self, record):
        e = record.exc_info[1] if record.exc_info else None
        if e is not None and f"{os.sep}orbax{os.sep}" in record.pathname and _disk_full(e):
            record.msg, record.args = "Orbax: %s failed: %s", (record.funcName, _short(e, 200))
            record.exc_info, record.exc_text = None, None
        return True


@functools.cache  # once per process
def _shorten_disk_full_logs() -> None:
    std_logging.getLogger("absl").addFilter(_ShortDiskFullLogs())


@functools.cache  # installed once, with the first manager
def _drop_closed_loop_noise() -> None:
    """After Orbax gives up on a failed read or write it closes its event loop while
    tensorstore still completes the others. Each completion then raises "Event loop is closed"
    as an unraisable exception, and each abandoned one (a coroutine or task) reports its own
    tensorstore error as unraisable or as asyncio's "exception was never retrieved": hundreds
    of traceback lines that say nothing the first error did not. Drop only those."""
    previous = sys.unraisablehook

    def noise(e) -> bool:
        text = str(e)
        return (
            text == "Event loop is closed"
            or "TensorStore" in text
            or "OCDBT" in text
            or "'_read_array_index_and_device_put' was never awaited" in text
        )

    def hook(unraisable):
        if not noise(unraisable.exc_value):
            previous(unraisable)

    def keep(record) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        return not ("never retrieved" in record.getMessage() and noise(e))

    sys.unraisablehook = hook
    std_logging.getLogger("asyncio").addFilter(keep)
