"""The `checksums` item: each array's checksum, recorded at save time and verified on restore.

Every save records a checksum of each array's values (`<step>/checksums/checksums.json`; two
32-bit position-weighted sums of the bit patterns, computed on the devices where the arrays
live and fetched by the background commit, so any single changed value always changes them and
the loop does not wait); every restore recomputes them on the restored arrays and refuses a step
whose values differ, naming the array, or whose checksums file lacks one of them (`_verify`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint import future as ocp_future

from tfjax.runner.checkpoint.compatibility import _path_str
from tfjax.runner.checkpoint.errors import UnusableCheckpointError
from tfjax.runner.checkpoint.handlers import _FileItemHandler
from tfjax.runner.checkpoint.paths import _step_dir

CHECKSUMS_FILE = "checksums.json"  # in the step's "checksums" item


def _bits(x):
    """Each element's bit pattern as uint32 (8-byte types: one uint32 per 32-bit word)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size < 4:
        return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(
            jnp.uint32
        )
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _checksum(x):
    """[2] uint32: two sums (mod 2**32) of each element's bits times an odd weight of its
    position. The weight is a product of one odd number per axis, so it is odd and invertible
    mod 2**32: changing any one element always changes both sums; the two weightings differ, so
    other changes collide with a chance of about 2**-64. Reducing one axis at a time with its
    weights costs a multiply-add per element and sums a sharded array where it lies."""
    u = _bits(x)
    sums = []
    for salt in (0x9E3779B1, 0x85EBCA77):
        h = u
        for axis in reversed(range(u.ndim)):
            position = jnp.arange(u.shape[axis], dtype=jnp.uint32)
            weight = position * jnp.uint32(salt) + jnp.uint32(2 * axis + 1) | 1
            h = jnp.sum(h * weight, axis=-1, dtype=jnp.uint32)
        sums.append(h)
    return jnp.stack(sums)


@functools.cache
def _checksums_fn(out_sharding):
    return jax.jit(lambda leaves: [_checksum(x) for x in leaves], out_shardings=out_sharding)


def _start_checksums(tree) -> dict:
    """{"params/encoder/.../kernel": [2] uint32 device array} of each leaf, dispatched (not
    waited for): one program per device set, on the devices that hold the arrays."""
    groups = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf is None:
            continue
        x = leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf)
        groups.setdefault(frozenset(x.sharding.device_set), []).append((_path_str(path), x))
    out = {}
    for members in groups.values():
        first = members[0][1].sharding
        replicated = (
            jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
            if isinstance(first, jax.sharding.NamedSharding)
            else None
        )
        sums = _checksums_fn(replicated)([x for _, x in members])
        out.update({name: s for (name, _), s in zip(members, sums, strict=True)})
    return out


def _hex(sums: dict) -> dict[str, str]:
    return {name: f"{int(a):08x}{int(b):08x}" for name, (a, b) in jax.device_get(sums).items()}


def checksums(tree) -> dict[str, str]:
    """{"params/encoder/.../kernel": "89abcdef01234567"}: each array's checksum (16 hex digits),
    as `save` records them in `<step>/checksums/checksums.json`."""
    return _hex(_start_checksums(tree))


class _PendingChecksums:
    """Checksums that a save starts (dispatches to the devices) once, and its writer waits for
    at most `timeout_s` (the save's checkpoint.timeout_s)."""

    def __init__(self, timeout_s: float):
        self._timeout_s, self._sums, self._error = timeout_s, None, None
        self._started = threading.Event()

    def start(self, tree) -> None:
        if self._started.is_set():
            return
        try:
            self._sums = _start_checksums(tree)
        except BaseException as e:  # the writer fails with it instead of waiting
            self._error = e
            raise
        finally:
            self._started.set()

    def text(self) -> str:
        if not self._started.wait(self._timeout_s):
            raise TimeoutError(f"the checksums were not started within {self._timeout_s} s")
        if self._error is not None:
            raise RuntimeError("computing the checksums failed") from self._error
        return json.dumps(_hex(self._sums))


class ChecksumsHandler(_FileItemHandler):
    """Writes the arrays' checksums as JSON (process 0). They are computed on the devices; the
    save only starts that computation, and the background commit waits for the 16 bytes per
    array, so the training loop never waits for it."""

    async def async_save(self, directory: epath.Path, args: ChecksumsSave):
        async def write():
            self.save(directory, args)

        return [ocp_future.CommitFutureAwaitingContractedSignals(write(), name="checksums")]

    def save(self, directory: epath.Path, args: ChecksumsSave):
        if jax.process_index() == 0:  # the sums are replicated: the others fetch nothing
            (directory / CHECKSUMS_FILE).write_text(args.sums.text())

    def restore(self, directory: epath.Path, args=None):  # restores verify with the file itself
        return json.loads((directory / CHECKSUMS_FILE).read_text())


@ocp.args.register_with_handler(ChecksumsHandler, for_save=True)
@dataclasses.dataclass
class ChecksumsSave(ocp.args.CheckpointArgs):
    sums: _PendingChecksums


def _verify(manager, step: int, restored: dict, *, written: bool) -> None:
    """Raises UnusableCheckpointError naming the arrays whose values differ from the checksums
    recorded at save time, or the checksums file when it does not hold one of each restored
    array. `written`: the step was written with its checksums item (a step saved before tfjax
    recorded them: a warning)."""
    path = _step_dir(manager, step) / "checksums" / CHECKSUMS_FILE
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        if written:
            raise UnusableCheckpointError(f"{path}: missing") from None
        logging.warning(
            "Checkpoint %s/%d records no checksums (written before tfjax recorded "
            "them): its values are not verified.",
            manager.directory,
            step,
        )
        return
    except (ValueError, UnicodeDecodeError) as e:
        raise UnusableCheckpointError(f"{path}: not valid JSON ({e})") from None
    now = checksums(restored)
    missing = sorted(now.keys() - stored.keys()) if isinstance(stored, dict) else sorted(now)
    if missing:
        raise UnusableCheckpointError(
            f"{path}: damaged: it holds no checksum of {missing[0]}"
            + (f" (nor of {len(missing) - 1} more arrays)" if len(missing) > 1 else "")
        )
    bad = sorted(k for k in now if stored[k] != now[k])
    if bad:
        raise UnusableCheckpointError(
            f"{manager.directory}/{step}: the values of {bad[0]}"
            + (f" (and {len(bad) - 1} more arrays)" if len(bad) > 1 else "")
            + " differ from the checksums recorded when it was saved (the files were changed "
            "or damaged on disk)"
        )
