"""The target: the compile-only devices of a TPU slice or of GPU hosts (or this host's CPU
devices), and the memory a program may use on one of them.

    devices = topology.topology_devices("v5e:4x4", num_slices=2)   # compile-only devices
    devices = topology.topology_devices("h100:2x8")                # 2 hosts of 8 H100s
"""

from __future__ import annotations

import math
import os
import shutil

import jax
from jax.experimental import topologies

from tfjax.runner import chips, host_memory
from tfjax.runner.aot.report import gib

TPU_FORMS = {  # generation -> how many dimensions its topology names
    "v4": 3,
    "v5e": 2,
    "v5p": 3,
    "v6e": 2,
}
TOPOLOGY_HELP = (
    "TPU slices v4:AxBxC, v5e:AxB, v5p:AxBxC, v6e:AxB (chips per dimension, e.g. v5e:4x4; "
    "--num_slices for several slices); GPU nodes a100:N, h100:N, h200:N (N GPUs on one host) "
    "or h100:HxN (H hosts of N GPUs); cpu:N (N of this host's CPU devices: saved executables "
    "the runner loads on this host, `tfjax.runner.executables`)"
)
# JAX's GPU client preallocates this share of each GPU's memory and allocates only from it
# (XLA_PYTHON_CLIENT_MEM_FRACTION, default .75): what a program may use on a GPU.
GPU_MEM_FRACTION_DEFAULT = 0.75


def platform_of(topology: str) -> str:
    """ "tpu", "cuda" or "cpu" for a topology name; ValueError listing the accepted forms."""
    name = topology.partition(":")[0].lower()
    if name in TPU_FORMS:
        return "tpu"
    if name == "cpu":
        return "cpu"
    if chips.gpu_chip(name) is not None:  # a GPU of the table, with what its compiler needs
        return "cuda"
    raise ValueError(f"topology {topology!r}: unknown chip {name!r}; accepted: {TOPOLOGY_HELP}")


def topology_devices(topology: str, *, num_slices: int = 1, platform: str | None = None) -> list:
    """The compile-only devices of a TPU slice ("v5e:4x4", `num_slices` of them) or of GPU
    hosts ("h100:8", "h100:2x8"). `platform` ("tpu" / "cuda"), when given, must agree.

    Raises ValueError naming the accepted forms, and RuntimeError naming what to install,
    before anything is compiled.
    """
    name, _, dims = topology.partition(":")
    name = name.lower()
    sizes = dims.split("x") if dims else []
    if not all(s.isdigit() and int(s) > 0 for s in sizes) or not sizes:
        raise ValueError(f"topology {topology!r} is not understood; accepted: {TOPOLOGY_HELP}")
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}")
    kind = platform_of(topology)
    if platform not in (None, kind):
        raise ValueError(
            f"platform {platform!r} does not match topology {topology!r}, a {kind} target; "
            f"accepted: {TOPOLOGY_HELP}"
        )
    if kind == "cuda":
        return _gpu_devices(topology, name, [int(s) for s in sizes], num_slices)
    if kind == "cpu":
        return _cpu_devices(topology, [int(s) for s in sizes], num_slices)
    if len(sizes) != TPU_FORMS[name]:
        raise ValueError(
            f"topology {topology!r}: {name} slices are named with {TPU_FORMS[name]} "
            f"dimensions; accepted: {TOPOLOGY_HELP}"
        )
    # Compile-only use: several processes may load libtpu at once (tests, scripts).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not host_memory.tpu_attached():
        # No TPU runtime to describe here but this one host. Left unset, libtpu looks for its
        # slice's hosts when it loads and prints an error for what it cannot find.
        os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    bounds = [int(s) for s in sizes] + [1] * (3 - len(sizes))
    # A slice smaller than a host (v5e:1x1, Colab's TPU) is a host of that many chips: libtpu's
    # default host of 2x2x1 chips would not divide it.
    small = dict(chips_per_host_bounds=tuple(bounds)) if math.prod(bounds) < 4 else {}
    try:
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=topology, num_slices=num_slices, **small
        )
    except RuntimeError as e:
        if "not installed" in str(e):
            raise RuntimeError(
                "compiling for a TPU needs libtpu: pip install 'libtpu==0.0.42.*' (or "
                "`pip install -e .[tpu]`)"
            ) from None
        raise
    return list(topo.devices)


def _gpu_devices(topology, name, sizes, num_slices) -> list:
    if len(sizes) > 2:
        raise ValueError(
            f"topology {topology!r}: GPU targets are {name}:N or {name}:HxN (hosts x GPUs per "
            f"host); accepted: {TOPOLOGY_HELP}"
        )
    if num_slices != 1:
        raise ValueError(
            f"num_slices applies to TPU slices; name several GPU hosts as {name}:HxN instead"
        )
    hosts, gpus = ([1] + sizes)[-2:]
    try:
        topo = topologies.get_topology_desc(
            topology_name=topology,
            platform="cuda",
            topology=f"1x{hosts}x{gpus}",
            target_config=gpu_target_config(chips.gpu_chip(name)),
        )
    except (RuntimeError, NotImplementedError) as e:  # without the CUDA plugin
        if any(m in str(e) for m in ("not implemented for cuda", "not installed", "Unknown")):
            raise RuntimeError(_GPU_INSTALL) from None
        raise
    if _ptxas() is None:
        raise RuntimeError(_GPU_INSTALL)
    return list(topo.devices)


def _cpu_devices(topology, sizes, num_slices) -> list:
    """N of this host's CPU devices ("cpu:N"): real ones, so that what is compiled for them (and
    saved, `tfjax.runner.executables`) runs here. JAX is asked for N when no backend has started
    yet; else the host must already have them (--xla_force_host_platform_device_count)."""
    if len(sizes) != 1 or num_slices != 1:
        raise ValueError(
            f"topology {topology!r}: the host's CPU devices are named cpu:N (no slices); "
            f"accepted: {TOPOLOGY_HELP}"
        )
    (n,) = sizes
    from tfjax.runner import jax_internals

    if not jax_internals.backends_started():
        jax.config.update("jax_num_cpu_devices", n)
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise ValueError(
            f"topology {topology!r}: this process has {len(devices)} CPU device(s); start it "
            f"with XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    return devices[:n]


_GPU_INSTALL = (
    "compiling for a GPU needs JAX's CUDA plugin and ptxas: pip install "
    "'jax-cuda12-plugin==<your jaxlib version>' nvidia-cuda-nvcc-cu12 (`make install-dev` does)"
)


def _ptxas() -> str | None:
    """The ptxas that XLA's GPU compiler will find: the pip CUDA compiler, else on PATH."""
    try:
        import nvidia.cuda_nvcc

        for root in nvidia.cuda_nvcc.__path__:
            path = os.path.join(root, "bin", "ptxas")
            if os.access(path, os.X_OK):
                return path
    except ImportError:
        pass
    return shutil.which("ptxas") or shutil.which("ptxas", path="/usr/local/cuda/bin")


def gpu_target_config(chip: chips.Chip) -> str:
    """The GpuTargetConfigProto text that lets XLA compile for `chip` without it (tfjax.runner.chips
    figures; the cuDNN version is the one the CUDA 12 wheels of this JAX require)."""
    g = chip.gpu
    major, minor = g.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {g.shared_memory_per_sm}
  shared_memory_per_block_optin: {g.shared_memory_per_sm - 1024}
  threads_per_core_limit: 2048
  core_count: {g.sms}
  fpus_per_core: {g.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(g.memory_bandwidth)}
  l2_cache_size: {g.l2_bytes}
  clock_rate_ghz: {g.clock_ghz}
  device_memory_size: {chip.hbm_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{g.device_kind}"
"""


def usable_memory(spec: chips.DeviceSpec | None) -> tuple[int, str]:
    """Bytes a program may use on one device, and what they are: a TPU's HBM; on a GPU, the
    share of its memory JAX's client preallocates (XLA_PYTHON_CLIENT_MEM_FRACTION, .75)."""
    if spec is None:
        return 0, ""
    if spec.chip.gpu is None:
        return spec.hbm_bytes, "HBM"
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEM_FRACTION_DEFAULT))
    label = (
        f"GPU memory JAX allocates from ({fraction:.0%} of {gib(spec.hbm_bytes)}, "
        "XLA_PYTHON_CLIENT_MEM_FRACTION)"
    )
    return int(spec.hbm_bytes * fraction), label
