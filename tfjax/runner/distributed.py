"""Multi-process start-up: jax.distributed.initialize() within a deadline that names who is late.

    distributed.initialize(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=0,
                           timeout_s=300, heartbeat_timeout_s=100)

JAX ends a process that cannot connect in time from C++ (abort, status 134): Python cannot
catch it. So a watchdog prints tfjax's message at the deadline, and the coordinator's
registration deadline (a few seconds later) makes JAX's error that follows name the missing
processes. Once running, a process without heartbeats for `heartbeat_timeout_s` is named by
JAX's coordination service, which ends every other process with an error.
"""

from __future__ import annotations

import os
import sys
import threading

from tfjax.runner import jax_internals

# JAX's own deadlines run this much past timeout_s, so that ours speaks first.
COORDINATOR_GRACE_S = 5  # the coordinator's registration deadline: its error names the missing
CLIENT_GRACE_S = 30  # a process's own deadline to reach the coordinator (process 0 missing)


def initialize(
    *,
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    timeout_s: int,
    heartbeat_timeout_s: int,
) -> None:
    """jax.distributed.initialize() within `timeout_s`, or an exit naming who is missing.

    None arguments are detected by JAX (JAX_COORDINATOR_ADDRESS, SLURM, Cloud TPU). CPU
    processes exchange data through gloo.
    """
    import jax

    for name, value in (("timeout_s", timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1 (seconds), got {value}")
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or "(detected)"
    count = num_processes or "all"

    def not_connected():
        who = (
            "process(es) not connected are named in JAX's error that follows ('Some timed out "
            "task names')"
            if process_id == 0
            else f"process {process_id} could not reach process 0 (the coordinator) at "
            f"{address}, or another process did not connect (JAX's error that follows says which)"
        )
        print(
            f"jax.distributed.initialize: not all {count} processes connected to {address} "
            f"within {timeout_s} s (--distributed_timeout); {who}. Check that every process was "
            "started, with the same --coordinator_address and --num_processes.",
            file=sys.stderr,
            flush=True,
        )
        watchdog.finished.wait(CLIENT_GRACE_S + 30)  # JAX aborts first; if it does not:
        if not watchdog.finished.is_set():
            os._exit(1)

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    watchdog = threading.Timer(timeout_s, not_connected)
    watchdog.daemon = True
    watchdog.start()
    try:
        with jax_internals.coordinator_register_timeout(timeout_s + COORDINATOR_GRACE_S):
            jax.distributed.initialize(
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
                initialization_timeout=timeout_s + CLIENT_GRACE_S,
                heartbeat_timeout_seconds=heartbeat_timeout_s,
                shutdown_timeout_seconds=timeout_s,
            )
    finally:
        watchdog.cancel()
