"""tfjax.runner.host_memory: freed host memory is reused, so a jitted step stops page-faulting its
temporaries in; it applies only to CPU runs and before JAX's backend starts.

Page faults are counted (getrusage), never timed. Each case runs in a fresh process: the
setting must come before JAX starts its threads.
"""

from conftest import plain_env, run_python

from tfjax.runner import host_memory

# A jitted function with a 64 MiB temporary (the barrier keeps XLA from fusing it away) and a
# 64 MiB output, called 40 times after 50 warm-up calls; prints the setting's answer and the page
# faults per call. With kept memory the heap grows (faults) on some of the first calls, until
# it holds the blocks that fragmentation needs (here by call ~50, at 2.4x the first size).
_STEP = """
import resource, sys
from tfjax.runner import host_memory
answer = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else "not asked"
import jax, jax.numpy as jnp

@jax.jit
def step(x):
    y = jax.lax.optimization_barrier(x * 2.0)
    return y + 1.0

x = jnp.ones((16 * 2**20,), jnp.float32)
def call():
    step(x).block_until_ready().delete()  # freed now, not when the runtime gets to it

for _ in range(50):
    call()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    call()
print(answer, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 40)
"""


def _run(*args, env=None, unset=()):
    env = plain_env(**(env or {}))  # one CPU device, as a plain run
    for name in unset:
        env.pop(name, None)
    proc = run_python("-c", *args, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_kept_memory_stops_the_page_faults_of_each_step():
    answer, glibc = _run(_STEP, "glibc").rsplit(" ", 1)
    # glibc maps a 64 MiB block afresh on every call: 16,384 pages.
    assert int(glibc) > 15_000, glibc
    answer, kept = _run(_STEP, "keep").rsplit(" ", 1)
    assert answer == "applied"
    assert int(kept) < int(glibc) / 4, (kept, glibc)


def test_not_applied_once_jax_has_started_or_off_the_cpu():
    # This process's JAX backend is running (conftest listed the devices).
    assert host_memory.jax_backend_started()
    assert host_memory.keep_freed_memory() == "JAX's backend already started"
    code = "from tfjax.runner import host_memory; print(host_memory.keep_freed_memory())"
    assert _run(code, env={"JAX_PLATFORMS": "tpu"}) == "not a CPU run"
    assert _run(code, env={"JAX_PLATFORMS": "cpu"}) == "applied"


def test_an_installed_accelerator_plugin_without_the_device_is_a_cpu_run(tmp_path):
    """libtpu is installed in the test environment (to compile for TPUs ahead of time), yet no
    TPU is attached here: the host computes on the CPU. With a TPU's device file present (a
    stand-in file matched by TPU_DEVICE_FILES), the same host counts as a TPU host."""
    import importlib.util

    assert importlib.util.find_spec("libtpu") is not None, "the test environment installs libtpu"
    code = (
        "import sys; from tfjax.runner import host_memory as h; "
        "h.TPU_DEVICE_FILES = tuple(sys.argv[1:]) or h.TPU_DEVICE_FILES; "
        "print(h.computes_on_cpu(), h.keep_freed_memory())"
    )
    assert _run(code, unset=["JAX_PLATFORMS"]) == "True applied"
    fake = tmp_path / "accel0"
    fake.write_text("")
    assert _run(code, str(fake), unset=["JAX_PLATFORMS"]) == "False not a CPU run"
