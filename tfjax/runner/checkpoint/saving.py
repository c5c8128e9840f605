"""Saving a step, and what a crash or a failed write leaves behind.

Crash safety (what a SIGKILL at any moment leaves behind):
  * Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it to `<step>` only
    when every file (and every process's data position) is written, so a listed step is always
    complete; temporary directories of interrupted saves are removed when a manager is made.
  * Old steps are not deleted in place (an interrupted `rmtree` would leave a listed but
    partial step): they are first renamed, atomically, into `<checkpoints>/TRASH/` and removed
    from there (after each save and when a manager is made).
  * A failed asynchronous write raises at the next save or when the run ends
    (`wait_until_finished`), and its step never becomes a complete directory.
  * A save that raises after it started the writes waits for them to end (they need nothing
    more from it) and raises its own error, within seconds.
A write that fails (a full disk) stops the run with one error naming the directory, the step
and the free space; older steps are untouched. TRASH is emptied when the manager closes: a
finished run keeps `keep` steps, no more.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

import orbax.checkpoint as ocp

from tfjax.runner.checkpoint.data_position import DataSave
from tfjax.runner.checkpoint.errors import CheckpointWriteError, _disk_full
from tfjax.runner.checkpoint.integrity import ChecksumsSave, _PendingChecksums
from tfjax.runner.checkpoint.metadata import FORMAT, versions
from tfjax.runner.checkpoint.paths import empty_trash


def save(manager, step: int, *, params, state: dict, data_state: dict | None, metrics=None):
    """Starts saving (returns once arrays are copied off the devices when async).

    Waits for the previous asynchronous save first, and raises its error if it failed
    (CheckpointWriteError for a full disk).
    """
    items = dict(params=ocp.args.PyTreeSave(params), state=ocp.args.PyTreeSave(state))
    if data_state is not None:
        items["data"] = DataSave(data_state, step)
    # Written by the background commit, which waits for them (integrity.ChecksumsHandler); an async
    # save starts them after its copy off the devices, so that the two never compete.
    sums = _PendingChecksums(manager._options.async_options.timeout_secs)  # noqa: SLF001
    items["checksums"] = ChecksumsSave(sums)
    tree = {"params": params, "state": state}
    if not manager._options.enable_async_checkpointing:  # noqa: SLF001 - no public getter
        sums.start(tree)
    with _write_errors(manager, step):
        try:
            manager.save(
                step,
                args=ocp.args.Composite(**items),
                metrics=metrics,
                force=True,
                custom_metadata={"versions": versions(), "tfjax_format": FORMAT},
            )
        except BaseException:
            # manager.save may raise after starting the writes; _write_errors then waits for
            # them, and the checksums item among them waits for this start.
            with contextlib.suppress(Exception):  # its own error is the writer's to raise
                sums.start(tree)
            raise
        sums.start(tree)
    manager.tfjax_writing = step  # named if its background write fails
    # The previous save (and its deletions) finished inside manager.save.
    empty_trash(manager.directory, background=True)


def wait_until_finished(manager) -> None:
    """manager.wait_until_finished(), raising a failed save's error only once the writes of
    that save's other items have ended."""
    with _write_errors(manager, None):
        manager.wait_until_finished()


def close(manager) -> None:
    """Waits for the last save (raising its error), closes the manager and empties TRASH, so
    that a finished run keeps `keep` steps on disk and no deleted one."""
    try:
        wait_until_finished(manager)
    finally:
        manager.close()
        if not manager._options.read_only:  # noqa: SLF001 - Orbax has no public getter
            empty_trash(manager.directory)


@contextlib.contextmanager
def _write_errors(manager, step):
    """Lets a failed save's other writes end first; a full disk becomes one short error."""
    try:
        with _unfinished_writes_end_before_errors(manager):
            yield
    except Exception as e:
        if not _disk_full(e):
            raise
        directory = os.fspath(manager.directory)
        failed = getattr(manager, "tfjax_writing", step)
        usage = shutil.disk_usage(directory)
        latest = manager.latest_step()
        error = CheckpointWriteError(
            f"checkpoint step {failed} could not be written to {directory}: no space left on "
            f"the device ({usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB). "
            + (
                f"The newest complete checkpoint, step {latest}, is intact"
                if latest is not None
                else "No complete checkpoint was written"
            )
            + "; the partial step is removed at the next start. Free space (or move the "
            "workdir), then run the same command again to resume."
        )
        error.errno = errno.ENOSPC
        raise error from None


@contextlib.contextmanager
def _unfinished_writes_end_before_errors(manager):
    """On an error, waits for every write of the last asynchronous save to end, then raises.

    Orbax reports a failed save at its first failed item while the other items may still be
    writing into the step's temporary directory. Raised then, the error would let the same
    process (a notebook, a retry) save that step again, or remove the directory, while those
    writes go on: "Directory not empty" from the removal, or stale files in the new save. Orbax
    has no public call for this, so it reads the commit futures it keeps; if that attribute
    moves in another Orbax version this waits for nothing, as before. Each wait is bounded by
    the save's own timeout (checkpoint.timeout_s).
    """
    try:
        yield
    except BaseException:
        async_manager = getattr(getattr(manager, "_checkpointer", None), "_async_manager", None)
        timeout = getattr(async_manager, "_timeout_secs", None)
        for commit in getattr(async_manager, "_commit_futures", None) or ():
            try:
                commit.result(timeout=timeout)
            except Exception:  # the save's error is already being raised
                pass
        raise
