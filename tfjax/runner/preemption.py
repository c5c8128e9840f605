"""Stopping on signals: preemption (SIGTERM) and Ctrl-C (SIGINT) end a run after a saved step.

One process: a Python signal handler sets a flag the loop reads after every step (no host
sync). Several processes: SIGTERM goes to JAX's preemption service (its handler, installed by
jax.distributed.initialize), which agrees on one step for all processes through the
coordination service, read each step with `manager.reached_preemption`; SIGINT is turned into
SIGTERM to join the same path. With that service switched off, the flags of all processes are
combined at log steps instead (the loop's existing host sync). A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from tfjax.runner import jax_internals


def _preemption_service() -> bool:
    """Whether JAX's preemption service runs (multi-process, jax.distributed initialised)."""
    return jax.process_count() > 1 and jax_internals.preemption_service_running()


class StopSignals:
    """SIGTERM and SIGINT ask the loop to stop after the current step (see the module docstring).

    `signal` is the name of the first signal this process received (None: none). Installed
    only from the main thread (Python delivers signals there); restored on exit.
    """

    def __init__(self):
        self.signal = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        wanted = [signal.SIGINT]
        if not _preemption_service():  # else SIGTERM is the service's (its C++ handler)
            wanted.append(signal.SIGTERM)
        for signum in wanted:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        self.signal = self.signal or name
        logging.warning(
            "%s received: finishing the current step, then saving a checkpoint and stopping%s",
            name,
            " (Ctrl-C again to abort at once)" if signum == signal.SIGINT else "",
        )
        if signum != signal.SIGTERM and _preemption_service():
            os.kill(os.getpid(), signal.SIGTERM)  # join the path every process agrees on

    def reached(self, manager, step: int, log_step: bool) -> bool:
        """Whether to save and stop after `step`; the same answer on every process."""
        if jax.process_count() == 1:
            return self.signal is not None
        if _preemption_service():
            return manager.reached_preemption(step)
        if not log_step:
            return False
        # No preemption service: combine the flags at log steps (a host sync happens anyway).
        flags = multihost_utils.process_allgather(np.int32(self.signal is not None))
        return bool(np.any(flags))


def primary_first(fn):
    """Runs fn on process 0, then on the others (who then find what it prepared: datasets,
    tokenizers), so that several processes never build the same files at once."""
    if jax.process_count() == 1:
        return fn()
    out = fn() if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("tfjax: primary prepared data")
    return out if jax.process_index() == 0 else fn()
