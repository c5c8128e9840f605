"""Test set-up (8 CPU devices for the sharding tests, before any JAX backend starts) and the
helpers that several test files share: config overrides, the session's data directory, child
processes (the runner, Python, two processes on one host) and reading a run's checkpoints."""

import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
import time

# XLA:CPU compiles without LLVM's optimisations and with its older fusion emitters (JAX's own
# tests do the first, as jax_disable_most_optimizations). The suite's programs are tiny, so
# compiling them was most of its time: tests/models/test_models.py took 3x less CPU time with
# these flags, and the ahead-of-time TPU and GPU compiles report the same figures. Every JAX
# process the suite starts gets them too (xla_flags), so results compared across processes come
# from the same machine code. jaxlib 0.12 has only the fusion emitters: XLA aborts the process on
# the flag that chose the older ones, so it is passed to older jaxlibs only.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 12):
    FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a JAX process the suite starts: FAST_COMPILE, and `devices` simulated CPU
    devices where given."""
    count = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return FAST_COMPILE + count


# Must happen before JAX initialises a backend. Flags the caller set win.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:
    _flags += " " + FAST_COMPILE
os.environ["XLA_FLAGS"] = _flags.strip()

# One thread per worker for torch (the interop references), OpenMP and BLAS: pytest-xdist runs a
# worker per core already, and threads that spin-wait for a busy core made the references'
# generate calls up to 75 times slower on a loaded 2-core host.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# libtpu is installed for the ahead-of-time compile tests; without a TPU attached, JAX must not
# try to start a TPU backend (slow, noisy): the suite computes on the CPU, as the runner does.
from tfjax.runner import startup  # noqa: E402

startup.choose_platform()

import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "experiments", "run.py")
VIT_TINY = os.path.join(ROOT, "configs", "vit.py") + ":tiny"


def _has(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    for platform in ("gpu", "tpu"):
        if _has(platform):
            continue
        skip = pytest.mark.skip(reason=f"needs a {platform.upper()}; none on this machine")
        for item in items:
            if platform in item.keywords:
                item.add_marker(skip)


def set_fields(config, overrides: dict):
    """Sets {"optim.learning_rate": 0.1, ...} on a config, as --config.<key>= does; returns it."""
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        target = config
        for p in parents:
            target = target[p]
        target[leaf] = value
    return config


def _session_root(tmp_path_factory):
    """The session's temporary folder, one for all pytest-xdist workers (each worker's own
    basetemp is a folder inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """One data directory for the session and its workers: embedded datasets are prepared on
    first use, once (tfjax.data.prepare holds a lock while it builds)."""
    return str(_session_root(tmp_path_factory) / "tfjax_data")


# A size limit turns on the cache's file lock (no limit in practice): a process never reads an
# entry that another is still writing (a torn read is a warning, which the suite makes an error).
CACHE_MAX_BYTES = 1 << 40


def _cache_dir(tmp_path_factory) -> str:
    return str(_session_root(tmp_path_factory) / "jax_cache")


@pytest.fixture(scope="session")
def runner_env(tmp_path_factory):
    """The environment of runner subprocesses: a compilation cache shared by every worker's
    runs makes restarts, and the same config run by another test, quick."""
    return dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=_cache_dir(tmp_path_factory),
        JAX_COMPILATION_CACHE_MAX_SIZE=str(CACHE_MAX_BYTES),
        PYTHONPATH=ROOT,
    )


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache in this process while a test module runs, in the
    directory runner_env gives the runner's subprocesses: a run that compiles what an earlier
    one compiled (a resumed run, the same config in another test, worker or subprocess) loads
    the program instead. Modules that train through the runner ask for it (pytestmark); the
    others, ahead-of-time TPU and GPU compiles among them, keep compiling every program."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    names = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size")
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", _cache_dir(tmp_path_factory))
    jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    cc.reset_cache()  # JAX decides whether to use the cache once, at its first compile
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    cc.reset_cache()


@pytest.fixture(scope="session")
def v5e():
    """Compile-only devices of a v5e:2x2 slice (libtpu's compiler on this host)."""
    from tfjax.runner import aot

    return aot.topology_devices("v5e:2x2")


# ---------------------------------------------------------------------------- child processes
def plain_env(**extra) -> dict:
    """os.environ for a child that runs as a user would: without the 8 host devices above (with
    FAST_COMPILE, which changes how long compiling takes, not what the tests check)."""
    return {**os.environ, "XLA_FLAGS": xla_flags(), **extra}


def run_python(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    """`python *args` in the checkout, output captured; `env` is plain_env() unless given."""
    env = plain_env() if env is None else env
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def own_info_lines(stderr: str) -> list[str]:
    """The INFO lines Python logged on an entry point's stderr, each asserted to come from tfjax
    or the entry point (Orbax's come from files of its own: checkpoint_manager.py, ...)."""
    own = {name for _, _, files in os.walk(os.path.join(ROOT, "tfjax")) for name in files}
    own |= set(os.listdir(os.path.join(ROOT, "experiments")))
    lines = [re.match(r"I\d{4} [\d:.]+ +\d+ (\S+\.py):\d+\] ", x) for x in stderr.splitlines()]
    for m in filter(None, lines):
        assert m.group(1) in own, m.string
    return [m.string for m in lines if m]


def run_command(workdir, data_dir, overrides, *, config=VIT_TINY) -> list[str]:
    """experiments/run.py's command line, with --config.<key>=<value> for each override."""
    return [
        sys.executable,
        RUN,
        f"--config={config}",
        f"--workdir={workdir}",
        f"--config.data_dir={data_dir}",
        *(f"--config.{k}={v}" for k, v in overrides.items()),
    ]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a coordinator of local processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(cmd, process_id, env) -> subprocess.Popen:
    """Process `process_id` of a multi-process command, its output (stderr too) piped."""
    return subprocess.Popen(
        [*cmd, f"--process_id={process_id}"],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def wait_for_steps(workdir, n, proc, timeout=240):
    """Until metrics.jsonl has n lines (train steps logged); fails if `proc` exits first."""
    path = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        if os.path.exists(path):
            with open(path) as f:
                if sum(1 for _ in f) >= n:
                    return
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps in {timeout}s")


# --------------------------------------------------------------------------- a run's checkpoints
def listed_steps(workdir):
    """The steps tfjax.runner.checkpoint lists in a workdir (complete checkpoints only)."""
    from tfjax.runner import checkpoint

    manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"), read_only=True)
    try:
        return manager.all_steps()
    finally:
        manager.close()


def read_checkpoint(workdir, step):
    """{"params", "state", "data"} of a step as saved (numpy arrays, no target needed)."""
    import numpy as np
    import orbax.checkpoint as ocp

    directory = os.path.join(workdir, "checkpoints", str(step))
    out = {}
    with ocp.PyTreeCheckpointer() as ckptr:
        for item in ("params", "state"):
            path = os.path.join(directory, item)
            metadata = ckptr.metadata(path)
            tree = getattr(metadata, "item_metadata", metadata)
            tree = getattr(tree, "tree", tree)
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            out[item] = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    out["data"] = {}
    for name in sorted(os.listdir(os.path.join(directory, "data"))):
        if name.startswith("process_"):
            with open(os.path.join(directory, "data", name)) as f:
                out["data"][name] = json.load(f)
    return out


# ------------------------------------------------------------------ converted checkpoints


def save_pretrained(model, directory):
    """A transformers reference model written as `from_pretrained` reads it (quietly)."""
    import transformers

    transformers.logging.set_verbosity_error()
    model.save_pretrained(directory)
    return directory


def assert_params_identical(a, b):
    """Two parameter trees with the same keys, dtypes, shapes and bits."""
    import numpy as np

    from tfjax.interop.core.rules import flatten

    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), k


def module_fields(module) -> dict:
    """A Flax module's dataclass fields, without parent and name (to compare two models)."""
    import dataclasses

    return {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.init and f.name not in ("parent", "name")
    }


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """A worker runs many test files in one process: after each file, JAX's caches of traced
    and compiled programs are dropped, so a worker's memory does not grow with every file it
    has run (a worker near 7.6 GB was seen before a compiler segfault in a later file)."""
    yield
    jax.clear_caches()


# The LoRA tests' Gemma-2-shaped decoder at tiny sizes (Linen and NNX): sandwich norms, GeGLU,
# tied head, local and global layers, soft caps.
GEMMA2_TINY = dict(
    variant="gemma-2-2b",
    vocab_size=64,
    width=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    max_len=64,
    sliding_window=4,
)


def with_random_lora_b(params, seed=1):
    """LoRA params (boxed or not) with every adapter B drawn at random, as after some training
    (B starts at zero, which would hide a wrong adapter)."""
    import flax

    flat = flax.traverse_util.flatten_dict(flax.linen.meta.unbox(params))
    for i, key in enumerate(sorted(flat)):
        if key[-1].endswith("_lora_b"):
            k = jax.random.fold_in(jax.random.key(seed), i)
            flat[key] = 0.3 * jax.random.normal(k, flat[key].shape, flat[key].dtype)
    return flax.traverse_util.unflatten_dict(flat)
