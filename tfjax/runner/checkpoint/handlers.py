"""The Orbax handler bases of a step's items: the arrays' (params, state), whose read errors
come back as values, and that of tfjax's own files (data, checksums)."""

from __future__ import annotations

import dataclasses

import orbax.checkpoint as ocp
from etils import epath


@dataclasses.dataclass
class _ReadFailure:
    """What an item's restore returns instead of raising. Orbax's restore ends with a barrier
    of every process; an item that raised on one process only would skip it and leave the
    others waiting there. So every process reaches the barrier, and `restore` then agrees on
    the outcome (`_agree`) and raises on all of them."""

    error: BaseException


class _PyTreeHandler(ocp.PyTreeCheckpointHandler):
    """Orbax's PyTree handler whose read errors come back as a _ReadFailure."""

    def restore(self, directory: epath.Path, args=None):
        try:
            return super().restore(directory, args=args)
        except Exception as e:  # noqa: BLE001 - tensorstore and Orbax raise many kinds
            return _ReadFailure(e)


class _FileItemHandler(ocp.AsyncCheckpointHandler):
    """An item of tfjax's own files: no metadata, nothing to finalize or close."""

    def metadata(self, directory: epath.Path):
        return None

    def finalize(self, directory: epath.Path):
        pass

    def close(self):
        pass
