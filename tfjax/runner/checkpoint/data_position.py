"""The `data` item: each process's data loader position, in its own JSON file.

`<step>/data/process_<i>-of-<n>.json` holds the position of process i of n, the step it belongs
to and the SHA-256 of both: a damaged position, or one copied from another step, is refused. A
run with another number of processes finds no position of its own and starts its data anew.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future as ocp_future

from tfjax.runner.checkpoint.errors import UnusableCheckpointError
from tfjax.runner.checkpoint.handlers import _FileItemHandler, _ReadFailure
from tfjax.runner.checkpoint.paths import _read_json


def _data_file(directory: epath.Path) -> epath.Path:
    return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def _digest(content) -> str:
    """The SHA-256 of canonical JSON."""
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _data_text(state: dict, step: int) -> str:
    """The position as JSON, bound to its step, with the SHA-256 of both (checked on restore)."""
    return json.dumps({"step": step, "sha256": _digest([step, state]), "state": state})


def _read_data(path: epath.Path, step: int, *, bound: bool) -> dict:
    """The loader state in `path`, checked against its SHA-256 and, for a step whose positions
    are `bound` (FORMAT 2), that it is the position of `step`, not a copy of another step's."""
    stored = _read_json(path)
    fields = {"step", "sha256", "state"} if bound else {"sha256", "state"}
    if not bound and not (isinstance(stored, dict) and stored.keys() & fields):
        return stored  # written before the checksum: the loader state itself
    if not isinstance(stored, dict) or stored.keys() != fields:
        found = sorted(stored) if isinstance(stored, dict) else type(stored).__name__
        raise UnusableCheckpointError(f"{path}: its fields are damaged ({found})")
    content = [stored["step"], stored["state"]] if bound else stored["state"]
    if _digest(content) != stored["sha256"]:
        raise UnusableCheckpointError(f"{path}: its content does not match its SHA-256")
    if bound and stored["step"] != step:
        raise UnusableCheckpointError(
            f"{path}: it is the data position of step {stored['step']}, not of step {step} "
            "(copied from another step)"
        )
    return stored["state"]


class DataStateHandler(_FileItemHandler):
    """Saves each process's loader state (a JSON-serialisable dict) in its own file.

    Orbax's JSON handler writes from the primary process only; every process reads its own
    shard of the data, so each one saves its own position.
    """

    async def async_save(self, directory: epath.Path, args: DataSave):
        text = _data_text(args.state, args.step)  # now: the loader moves on during the write

        async def write():
            _data_file(directory).write_text(text)

        # Waits for Orbax's (possibly asynchronous) creation of `directory` before writing.
        return [ocp_future.CommitFutureAwaitingContractedSignals(write(), name="data_save")]

    def save(self, directory: epath.Path, args: DataSave):
        _data_file(directory).write_text(_data_text(args.state, args.step))

    def restore(self, directory: epath.Path, args: DataRestore):
        path = _data_file(directory)
        try:
            if not path.exists():
                ours = f"-of-{jax.process_count()}.json"
                others = [n for n in os.listdir(directory) if _DATA_FILE.fullmatch(n)]
                if others and not any(n.endswith(ours) for n in others):
                    return None  # saved by a different number of processes
                raise UnusableCheckpointError(f"{path}: missing (this process's data position)")
            return _read_data(path, args.step, bound=args.bound)
        except UnusableCheckpointError as e:
            return _ReadFailure(e)  # raised after Orbax's barrier (see _ReadFailure)


_DATA_FILE = re.compile(r"process_\d+-of-\d+\.json")


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    state: dict
    step: int


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    step: int
    bound: bool  # the step's positions name their step (FORMAT 2)
