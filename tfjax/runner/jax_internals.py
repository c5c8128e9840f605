"""The one place tfjax reaches into JAX's private modules (`jax._src`), each use with the public
API that would replace it. Each function degrades to a safe answer when JAX moves the thing it
reads, so a JAX upgrade breaks a feature here, with a clear error, never silently elsewhere.
"""

from __future__ import annotations

import contextlib
import sys


def backends_started() -> bool:
    """Whether JAX has started a backend (tfjax.runner.host_memory must act before that).

    Replace with a public `jax.extend.backend` query once one exists (0.10 has
    `backends()`, which starts them). Read without importing: not yet imported means not started.
    """
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bridge is not None and bridge.backends_are_initialized()


def preemption_service_running() -> bool:
    """Whether JAX's preemption sync service runs (jax.distributed initialised with it).

    Public JAX has `multihost_utils.reached_preemption_sync_point`, which raises when the
    service is off, but nothing that asks whether it is on.
    """
    from jax._src import distributed

    return distributed.global_state.preemption_sync_manager is not None


@contextlib.contextmanager
def coordinator_register_timeout(seconds: int):
    """Within the block, jax.distributed.initialize() starts its coordination service with a
    registration deadline of `seconds`, so that JAX's error names the processes that did not
    connect ("Some timed out task names: 1") instead of only "Deadline Exceeded".

    jax.distributed.initialize has no argument for it (its `initialization_timeout` is the
    clients'); the service factory takes `cluster_register_timeout`. Where this JAX's factory
    does not, nothing is patched and JAX's own deadline applies.
    """
    from jax._src import distributed

    make_service = distributed._jax.get_distributed_runtime_service
    if "cluster_register_timeout" not in (make_service.__doc__ or ""):
        yield
        return

    def service(*args, **kwargs):
        return make_service(*args, cluster_register_timeout=seconds, **kwargs)

    distributed._jax.get_distributed_runtime_service = service
    try:
        yield
    finally:
        distributed._jax.get_distributed_runtime_service = make_service
