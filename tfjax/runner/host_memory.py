"""Host memory of CPU runs: keep freed buffers for reuse instead of returning them to the OS.

    from tfjax.runner import host_memory
    host_memory.keep_freed_memory()   # first thing, before JAX computes anything

Why: XLA:CPU allocates the temporaries of each step (activations, gradients) as one block with
malloc: 794 MiB for GPT-2 small at batch 4 x 128. glibc serves a block that large from a fresh
mmap (a worker thread's arena always does, whatever M_MMAP_MAX says) and unmaps it when the step
ends, so every step first-touches every page again. `benchmarks/host_memory.py` on a 2-core
host, tfjax's train step with glibc's defaults / with this setting, 8 rotated rounds:
GPT-2 small 1,956 / 1,753 ms (0.90x; 205,442 / 0 page faults per step), the d512 L6 decoder
799 / 749 ms (0.94x), ViT-S/16 1,245 / 1,219 ms (0.98x).

keep_freed_memory() sets glibc's malloc to one arena (so XLA's worker threads allocate from the
main heap), no mmap, and no trimming of the heap's free top below 2 GiB. Step temporaries are
then carved from memory the process already holds: no page faults once the heap has grown to
what the steps need. The cost: the process keeps its peak heap, fragmentation can add to it
(peak RSS in the runs above: GPT-2 2.80 / 2.83 GiB, decoder 1.28 / 1.64, ViT 1.68 / 1.60), and
all threads share one arena lock. Hence it applies only where the process computes on the CPU
(JAX_PLATFORMS names cpu first, or no accelerator is attached), and only to threads
that have not allocated yet: call it before JAX starts its CPU backend.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import importlib.util
import os
import sys

from tfjax.runner import jax_internals

# mallopt parameters of glibc's <malloc.h>
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
KEEP_BYTES = 2**31 - 1  # the largest trim threshold mallopt takes (an int)
_applied = False


def computes_on_cpu() -> bool:
    """Whether JAX will compute on the CPU: JAX_PLATFORMS names cpu first, or no accelerator is
    attached. An installed plugin alone (libtpu, a CUDA or ROCm PJRT plugin) does not make a
    host an accelerator host: libtpu is installed on CPU hosts to compile for TPUs ahead of time.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if "jax" in sys.modules:
        platforms = sys.modules["jax"].config.jax_platforms or platforms
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not accelerator_attached()


# Device files of attached accelerators: TPU VMs (/dev/accel*, or /dev/vfio/N on v5e and later),
# NVIDIA GPUs (/dev/nvidia0...), AMD GPUs (/dev/kfd).
TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")
GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd")


def accelerator_attached() -> bool:
    """An installed JAX accelerator plugin and that accelerator's device files on this host."""
    gpu_plugin = bool(importlib.metadata.entry_points(group="jax_plugins")) or (
        importlib.util.find_spec("jax_plugins") is not None
    )
    return tpu_attached() or (gpu_plugin and _present(GPU_DEVICE_FILES))


def tpu_attached() -> bool:
    """libtpu installed and a TPU's device files on this host."""
    return importlib.util.find_spec("libtpu") is not None and _present(TPU_DEVICE_FILES)


def _present(patterns) -> bool:
    return any(glob.glob(p) for p in patterns)


def jax_backend_started() -> bool:
    """Whether JAX has started a backend (its threads then have their malloc arenas)."""
    return jax_internals.backends_started()


def keep_freed_memory() -> str:
    """Applies the malloc settings of the module docstring where they help; returns what it did:
    "applied", or why not ("not glibc", "not a CPU run", "JAX's backend already started")."""
    global _applied
    if _applied:
        return "applied"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (raises AttributeError on other C libraries)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not glibc"
    if not computes_on_cpu():
        return "not a CPU run"
    if jax_backend_started():
        return "JAX's backend already started"
    for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, KEEP_BYTES)):
        if mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            raise OSError(f"mallopt({param}, {value}) failed")
    _applied = True
    return "applied"
