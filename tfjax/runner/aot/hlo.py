"""Compile an experiment for a TPU slice or GPU hosts from a CPU host: fit, memory, FLOPs.

    devices = aot.topology_devices("v5e:4x4", num_slices=2)     # compile-only devices
    devices = aot.topology_devices("h100:2x8")                  # 2 hosts of 8 H100s
    report = aot.compile_experiment(config, devices)             # every step of the config
    print(aot.format_report(report))

No data, workdir or accelerator is needed: `tfjax.runner.setup.set_up` builds the steps the
runner would run, on a mesh of the topology's compile-only devices, with the batch shapes and
vocabulary planned from the config. Each step (train, eval, and decode for generating tasks)
is lowered and compiled by the target's own compiler, and the report gives what a launch would
meet: memory per device against the chip's HBM (`tfjax.runner.chips`), compile time, model FLOPs and
the ideal step time at the chip's peak bf16 rate (a lower bound: no step runs at peak), and the
bytes each kind of collective produces per step.

Measured how:
  memory    XLA's `memory_analysis()` of the compiled program, per device: arguments (state and
            batch), temporaries, and the peak. On a TPU the fit is the compiler's own: it
            refuses a program over its HBM ("RESOURCE_EXHAUSTED"), naming what it needed, and
            a program it compiles fits; its peak is XLA's (buffers live at the same time), which
            can be well below arguments + outputs (less donated) + temporaries, the sum of every
            buffer ("all buffers", shown beside the peak where they differ: libtpu compiles
            Llama 3.1 8B's train step at 54 rows of 2,048 tokens a v5p chip, peak 93.5 GiB of
            95, where that sum is 121.4 GiB). The GPU compiler refuses nothing, and JAX
            allocates a program's temporaries as one block, so there the peak is the larger of
            XLA's peak and that sum, compared with the share of GPU memory JAX allocates from
            (75% unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise). With buffers offloaded
            to host memory, whose bytes XLA's peak counts with HBM's, the peak is the sum.
  FLOPs     tfjax.runner.chips' count of the model (XLA's `cost_analysis()` counts a loop body
            once, so scanned layers would be undercounted, and gives nothing for GPUs). The float32
            share of matmul FLOPs is read from the program as lowered (StableHLO), before a
            backend rewrites its matmuls into library calls.
  collectives  each all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute
            of the compiled HLO: the bytes of the full array it works on (a reduce-scatter's
            operand, the others' result) times the trip counts of the loops around it (XLA's
            `known_trip_count`, else read from the loop's induction variable; a loop whose count
            cannot be read is counted once, with a warning). What XLA:TPU writes in other forms
            is named as what it is (`collective_bytes`): FSDP's gathers and gradient
            reduce-scatters done as collective matmuls (windowed einsums: loops of
            collective-permutes passing shards round the ring, each multiplied as it arrives; on
            8 chips each shard is passed 9 times, 9/8 of the array), and gathers written as
            all-reduces. Bytes, not time: the figure does not say which transfers the compiler
            overlaps with compute.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import shutil
import time

import jax
from jax.experimental import topologies

from tfjax import sharding, tasks
from tfjax.runner import chips, host_memory, setup

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
FIT_MARGIN = 0.10  # a peak above 90% of HBM is warned about: runtime buffers need room too
LARGE_REPLICATED_BYTES = 256 * 2**20  # a replicated state array above this is warned about
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# JAX's GPU client preallocates this share of each GPU's memory and allocates only from it
# (XLA_PYTHON_CLIENT_MEM_FRACTION, default .75): what a program may use on a GPU.
GPU_MEM_FRACTION_DEFAULT = 0.75


# ------------------------------------------------------------------------------ the target
def platform_of(topology: str) -> str:
    """ "tpu" or "cuda" for a topology name; ValueError listing the accepted forms."""
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
        f"GPU memory JAX allocates from ({fraction:.0%} of {_gib(spec.hbm_bytes)}, "
        "XLA_PYTHON_CLIENT_MEM_FRACTION)"
    )
    return int(spec.hbm_bytes * fraction), label


class CompileError(RuntimeError):
    """The target's compiler failed on a step for a reason other than memory."""


# ------------------------------------------------------------------------------ the report
@dataclasses.dataclass
class StepReport:
    name: str  # "train", "eval", "decode"
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int  # of HBM, what must fit (see the module's docstring): TPU, XLA's peak
    collectives: dict[str, float]  # kind -> bytes per step (see collective_bytes)
    f32_dot_fraction: float  # of the matmul FLOPs, the share with a float32 operand
    fits: bool
    error: str = ""  # the compiler's refusal, first line
    host_bytes: int = 0  # temporaries placed in host memory (remat policies that offload)
    # bodies of while loops whose trip count could not be read: their collectives count once
    loops_counted_once: list[str] = dataclasses.field(default_factory=list)
    total_bytes: int = 0  # arguments + outputs - aliased + temporaries: every buffer's bytes


@dataclasses.dataclass
class Report:
    config: str
    topology: str
    devices: str  # "16 x TPU v5 lite (...)"
    num_devices: int
    hbm_bytes: int  # per device: what a program may use (on a GPU, JAX's preallocated share)
    memory_label: str  # what hbm_bytes is: "HBM", or the GPU share
    peak_flops: float  # per device, bf16
    mesh: dict
    per_device_batch: float  # train rows per device (of the data-parallel axes)
    num_params: int
    param_bytes: int  # per device, as sharded
    opt_bytes: int  # per device: optimizer state, EMA, counters
    flops_per_step: float  # model FLOPs of one train step, all devices
    ideal_step_s: float  # flops_per_step / (devices x peak): a lower bound
    steps: list[StepReport]
    warnings: list[str]
    saved: list[str] = dataclasses.field(default_factory=list)  # files written (save_to)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.steps)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["fits"] = self.fits
        return d


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += _nbytes(shape, leaf.dtype)
    return total


def _nbytes(shape, dtype) -> int:
    """Bytes of an array; sub-byte dtypes (QLoRA's NF4 / int4 codes) at their bit width."""
    return math.prod(shape) * jax.dtypes.itemsize_bits(dtype) // 8


def compile_experiment(
    config, devices, *, topology: str = "", name: str = "", steps=None, save_to: str | None = None
) -> Report:
    """Compiles every step of `config` for `devices` (compile-only or real) and reports.

    topology, name: how the report names the target and the config.
    steps: which of "train", "eval", "decode" (default: all that the config has).
    save_to: a directory to write the executables a run starts with to (init, train, eval),
      with what they were compiled for, when every step fits (`tfjax.runner.executables.save`;
      report.saved lists the files); compiled with JAX's compilation cache off
      (`executables.fresh_compiles`).
    Raises ValueError for a bad config or mesh (naming the field) before compiling anything.
    """
    if save_to:
        from tfjax.runner import executables

        with executables.fresh_compiles():
            return _compile_experiment(config, devices, topology, name, steps, save_to)
    return _compile_experiment(config, devices, topology, name, steps, save_to)


def _compile_experiment(config, devices, topology, name, steps, save_to) -> Report:
    mesh = sharding.make_mesh(config.mesh, devices)
    inputs = setup.planned_inputs(config)
    exp = setup.set_up(config, mesh, inputs=inputs)
    spec = chips.of(devices[0], devices)
    hbm, memory_label = usable_memory(spec)
    peak = spec.peak_flops if spec else float("nan")
    state = exp.abstract_state
    param_bytes = _shard_bytes(state.params)
    warnings = _state_warnings(exp)
    wanted = steps or ("train", "eval", "decode")
    lowerings = {
        "train": lambda: exp.train_step.lower(state, exp.train_batch, exp.abstract_rng),
        "eval": lambda: exp.eval_step.lower(state.params, exp.eval_batch),
    }
    if "decode" in wanted and tasks.decode_eval(config):
        lowerings["decode"] = lambda: _lower_decode(exp, hbm)
    compiled = {}  # step -> executable, for save_to
    reports = [
        _compile_step(
            name,
            lower,
            hbm=hbm,
            bf16=config.dtype == "bfloat16",
            gpu=spec is not None and spec.chip.gpu is not None,
            keep=compiled,
        )
        for name, lower in lowerings.items()
        if name in wanted
    ]
    for r in reports:
        if r.fits and hbm and r.peak_bytes > (1 - FIT_MARGIN) * hbm:
            warnings.append(
                f"{r.name} step: peak {_gib(r.peak_bytes)} is {r.peak_bytes / hbm:.0%} of the "
                f"{_gib(hbm)} {memory_label} (over {1 - FIT_MARGIN:.0%}); runtime buffers may "
                "not fit"
            )
        if loops := r.loops_counted_once:
            more = f" and {len(loops) - 3} more" if len(loops) > 3 else ""
            warnings.append(
                f"{r.name} step: collectives counted once in {len(loops)} while loop(s) whose "
                f"trip count could not be read ({', '.join(loops[:3])}{more}): the collective "
                "bytes may be too low"
            )
        if r.f32_dot_fraction > 0.05:
            warnings.append(
                f"{r.name} step: {r.f32_dot_fraction:.0%} of the matmul FLOPs take a float32 "
                "operand under dtype=bfloat16 (something promotes the compute to float32)"
            )
    dp = sharding.data_parallel_size(mesh, exp.rules)
    saved = []
    if save_to and all(r.fits for r in reports):
        from tfjax.runner import executables

        saved = executables.save(save_to, exp, compiled, name=name)
    return Report(
        config=name,
        topology=topology,
        devices=chips.describe(devices),
        num_devices=len(devices),
        hbm_bytes=hbm,
        memory_label=memory_label,
        peak_flops=peak,
        mesh=dict(mesh.shape),
        per_device_batch=config.batch_size / dp,
        num_params=exp.num_params,
        param_bytes=param_bytes,
        opt_bytes=_shard_bytes(state) - param_bytes,
        flops_per_step=exp.flops_per_step,
        ideal_step_s=exp.flops_per_step / (len(devices) * peak),
        steps=reports,
        warnings=warnings,
        saved=saved,
    )


def _lower_decode(exp, hbm):
    """The eval-time generation of the runner (`tfjax.runner.evaluation`): the task's decode-eval
    hook says what it generates from the abstract eval batch (`DecodeEval.generate_args`), its
    parameters laid out for devices of `hbm` bytes."""
    from tfjax import decode

    prompts, kwargs = tasks.decode_eval(exp.config).generate_args(exp, exp.eval_batch)
    with sharding.logical_context(exp.mesh, exp.rules):
        params = exp.abstract_state.params
        return decode.lower(exp.model, params, prompts, eos_id=2, memory_bytes=hbm, **kwargs)


def _compile_step(
    name, lower, *, hbm: int, bf16: bool, gpu: bool, keep: dict | None = None
) -> StepReport:
    lowered = lower()
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
        if keep is not None:
            keep[name] = compiled
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory refusal is kept
        message = str(e)
        if not refused_for_memory(message):
            raise CompileError(
                f"{name} step: the compiler failed: {first_line(message)}{vmem_hint(message)}"
            ) from e
        used = refused_bytes(message)
        return StepReport(
            name,
            time.perf_counter() - start,
            0,
            0,
            0,
            0,
            used,
            {},
            0.0,
            fits=False,
            error=first_line(message),
        )
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    host = getattr(m, "host_temp_size_in_bytes", 0) or 0
    xla_peak = getattr(m, "peak_memory_in_bytes", 0) or 0
    if host or not xla_peak:  # XLA's peak counts buffers offloaded to host memory with HBM's
        peak = total
    elif gpu:  # JAX allocates a GPU program's temporaries as one block: all of it must fit
        peak = max(xla_peak, total)
    else:  # the TPU compiler's own peak: what it checks against HBM
        peak = xla_peak
    collectives, loops_counted_once = collective_bytes(compiled.as_text())
    return StepReport(
        name,
        seconds,
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
        m.temp_size_in_bytes,
        peak,
        collectives,
        f32_dot_fraction(lowered.as_text()) if bf16 else 0.0,
        # A TPU program the compiler accepts fits: it refuses one that does not.
        fits=not hbm or not gpu or peak <= hbm,
        host_bytes=host,
        loops_counted_once=loops_counted_once,
        total_bytes=total,
    )


def refused_for_memory(message: str) -> bool:
    """Whether a compiler's error message is its refusal of a program over the chip's memory
    (HBM). A kernel over its scoped VMEM ("E1001: CompileTimeScopedVmemOom", also
    RESOURCE_EXHAUSTED) is not: fewer rows do not cure it, the kernel's block sizes or libtpu's
    --xla_tpu_scoped_vmem_limit_kib do, so it is a compiler failure (see vmem_hint)."""
    if "vmem" in message.lower():
        return False
    return "RESOURCE_EXHAUSTED" in message or "Ran out of memory" in message


def vmem_hint(message: str) -> str:
    """What to do about a kernel's VMEM refusal; "" for any other message."""
    if "vmem" not in message.lower():
        return ""
    return (
        " (a kernel's scratch memory, not HBM: smaller kernel blocks, or a higher limit with "
        "LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=N)"
    )


def first_line(message: str) -> str:
    """The first non-blank line of a (long, multi-line) compiler message, at most 400 chars."""
    for line in message.splitlines():
        if line.strip():
            return line.strip()[:400]
    return message[:400]


def refused_bytes(message: str) -> int:
    """The bytes a refused program needs, from the TPU compiler's message ("the total memory
    required for HLO temporaries (20.00G) exceeds available HBM (15.75G)", or "Used 17.25G of
    15.25G hbm"); 0 when it gives none."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    for pattern in (
        r"required for [^(]*\(([\d.]+)([KMGT])\) exceeds",
        r"Used ([\d.]+)([KMGT]) of [\d.]+[KMGT] hbm",
    ):
        m = re.search(pattern, message)
        if m:
            return int(float(m.group(1)) * scale[m.group(2)])
    return 0


def _state_warnings(exp) -> list[str]:
    out = []
    if math.prod(exp.mesh.shape.values()) == 1:
        return out
    flat = jax.tree_util.tree_flatten_with_path(exp.abstract_state)[0]
    for path, leaf in flat:
        size = _nbytes(leaf.shape, leaf.dtype)
        if size > LARGE_REPLICATED_BYTES and leaf.sharding.is_fully_replicated:
            name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
            out.append(
                f"{name} {tuple(leaf.shape)} ({_gib(size)}) is replicated on every device: "
                "give it a sharded logical axis or raise mesh.fsdp / mesh.tensor"
            )
    return out


# ----------------------------------------------------------------------------- HLO reading
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64|c64)\[([\d,]*)\]")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_NAME = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = ")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_COLLECTIVE = re.compile(r"^(" + "|".join(COLLECTIVES) + r")(-start|-done)?$")
# XLA's SPMD partitioner names the loops of a windowed einsum (a collective matmul) so, and its
# own passes find them by these names: an all-gather or a reduce-scatter done as a ring of
# collective-permutes, each step's shard multiplied as it arrives.
_WINDOWED = {
    "windowed_dot_general_body_ag": "all-gather (collective matmul)",
    "windowed_dot_general_body_rs": "reduce-scatter (collective matmul)",
}
_PASSING = ("copy", "copy-start", "copy-done", "convert", "bitcast")  # what they hold, moved
# A reduce-scatter as XLA:TPU writes it: an all-reduce sliced, fused in a computation so named.
_REDUCE_SCATTER_FUSION = "all-reduce-scatter"


@dataclasses.dataclass
class _Instruction:
    name: str
    root: bool
    shape: str  # of the result
    opcode: str
    operands: list[str]  # their names
    literal: str  # the text in the parentheses (a constant's value)
    attributes: str  # the text after them

    def attribute(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attributes)
        return m.group(1) if m else None


def _instruction(statement: str) -> _Instruction | None:
    m = _NAME.match(statement)
    op = m and _OPCODE.search(statement, m.end())
    if not op:
        return None
    depth, end = 1, op.end()
    while depth and end < len(statement):
        depth += {"(": 1, ")": -1}.get(statement[end], 0)
        end += 1
    inside = statement[op.end() : end - 1]
    return _Instruction(
        name=m.group(2),
        root=bool(m.group(1)),
        shape=statement[m.end() : op.start()],
        opcode=op.group(1),
        operands=re.findall(r"%([\w.\-]+)", inside),
        literal=inside.strip(),
        attributes=statement[end:],
    )


def _computations(text: str) -> tuple[dict[str, list[_Instruction]], str | None]:
    """The computations of HLO text by name, and the entry's name.

    Read by brace depth, not line by line: an instruction's attributes may span lines and close
    braces at a line's start (the splash-attention kernel's metadata ends with `}}` mid-
    computation). Braces inside strings (backend_config's JSON) do not count.
    """
    comps, entry, name, depth, pending = {}, None, None, 0, []
    for line in text.splitlines():
        plain = _STRING.sub("", line)
        before, depth = depth, depth + plain.count("{") - plain.count("}")
        if before == 0:  # a module line, or a computation's header when it opens a brace
            m = _HEADER.match(line)
            name = m.group(1) if m and depth > 0 else None
            if name is not None:
                comps[name] = []
                entry = name if line.startswith("ENTRY") else entry
            depth = max(depth, 0)
        elif depth <= 0:  # the computation's closing brace
            name, depth, pending = None, 0, []
        else:
            pending.append(line)
            if depth == 1:  # the instruction is complete
                inst = _instruction(" ".join(pending))
                pending = []
                if inst is not None and name is not None:
                    comps[name].append(inst)
    return comps, entry


def _through(by_name: dict, name: str) -> _Instruction | None:
    """The instruction `name` is a copy, convert or bitcast of (or itself)."""
    inst = by_name.get(name)
    while inst is not None and inst.opcode in _PASSING:
        inst = by_name.get(inst.operands[0]) if inst.operands else None
    return inst


def _integer(inst: _Instruction | None) -> int | None:
    if inst is not None and inst.opcode == "constant" and re.fullmatch(r"-?\d+", inst.literal):
        return int(inst.literal)
    return None


def _element(inst: _Instruction | None, by_name: dict) -> int | None:
    """Which element of its computation's parameter `inst` reads (get-tuple-element), or None."""
    if inst is None or inst.opcode != "get-tuple-element" or not inst.operands:
        return None
    source = by_name.get(inst.operands[0])
    index = re.search(r"\bindex=(\d+)", inst.attributes)
    return int(index.group(1)) if source and source.opcode == "parameter" and index else None


def _trip_count(loop: _Instruction, caller: dict, comps: dict) -> int | None:
    """How many times a while loop runs its body: XLA's own figure (`known_trip_count` in the
    backend_config, where it has analysed the loop), else read from its induction variable (the
    initial value, the step the body adds, the bound and direction of the condition's compare);
    None when neither is there to read. A condition that also ends the loop early (decoding
    stops when every row has ended) gives the most it can run."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attributes)
    if known:
        return int(known.group(1))
    cond, body = comps.get(loop.attribute("condition")), comps.get(loop.attribute("body"))
    if not cond or not body or len(loop.operands) != 1:
        return None
    in_cond, in_body = {i.name: i for i in cond}, {i.name: i for i in body}
    init = _through(caller, loop.operands[0])
    update = next((i for i in body if i.root), None)
    if init is None or update is None or init.opcode != "tuple" or update.opcode != "tuple":
        return None
    counts = []
    for test in _conjuncts(next((i for i in cond if i.root), None), in_cond):
        direction = re.search(r"direction=(\w+)", test.attributes)
        if test.opcode != "compare" or not direction or len(test.operands) != 2:
            continue
        direction = direction.group(1)
        counter, bound = (_through(in_cond, o) for o in test.operands)
        if _element(counter, in_cond) is None:  # the bound on the left: read it the other way
            counter, bound = bound, counter
            direction = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}.get(direction, direction)
        index, bound = _element(counter, in_cond), _integer(bound)
        if index is None or bound is None or index >= len(init.operands):
            continue
        start = _integer(_through(caller, init.operands[index]))
        step = _step(_through(in_body, update.operands[index]), index, in_body)
        if start is not None and step:
            counts.append(_trips(start, step, direction, bound))
    counts = [c for c in counts if c is not None]
    return min(counts) if counts else None


def _conjuncts(inst: _Instruction | None, by_name: dict):
    """The conditions a loop's condition requires all of (the operands of its `and`s)."""
    if inst is not None and inst.opcode == "and":
        for o in inst.operands:
            yield from _conjuncts(_through(by_name, o), by_name)
    elif inst is not None:
        yield inst


def _step(change: _Instruction | None, index: int, body: dict) -> int | None:
    """What a loop's body adds to element `index` of its state each trip (the constant of
    `add(i, c)` or `subtract(i, c)`), or None."""
    if change is None or change.opcode not in ("add", "subtract") or len(change.operands) != 2:
        return None
    a, b = (_through(body, o) for o in change.operands)
    if change.opcode == "add" and _element(b, body) == index:
        a, b = b, a
    if _element(a, body) != index or _integer(b) is None:
        return None
    return _integer(b) * (1 if change.opcode == "add" else -1)


def _trips(start: int, step: int, direction: str, bound: int) -> int | None:
    """Iterations of `for (i = start; i <direction> bound; i += step)`; None if it never ends."""
    if direction in ("GT", "GE"):  # counting down: the mirror image of counting up
        start, step, bound, direction = -start, -step, -bound, "L" + direction[1]
    if direction == "LE":
        direction, bound = "LT", bound + 1
    if direction == "LT":
        if start >= bound:
            return 0
        return -((start - bound) // step) if step > 0 else None
    if direction == "NE":
        trips, left = divmod(bound - start, step)
        return trips if left == 0 and trips >= 0 else None
    return None


def _calls(comps, name) -> list[tuple[str, int | None, str | None]]:
    """(callee, times per run, collective-matmul label) for each computation `name` calls."""
    out, by_name = [], {i.name: i for i in comps[name]}
    for inst in comps[name]:
        if inst.opcode == "while":
            trips = _trip_count(inst, by_name, comps)
            out.append((inst.attribute("body") or "", trips, _window_label(inst)))
        elif inst.opcode not in ("async-update", "async-done"):  # async-start calls it once
            for group in re.findall(
                r"\b(?:calls|branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)",
                inst.attributes,
            ):
                out += [(c.strip(" {}%"), 1, None) for c in group.split(",") if c.strip(" {}")]
    return out


def _runs(comps, entry):
    """How many times each computation runs per run of the entry (loops multiply), the
    collective-matmul label of those inside a windowed einsum's loop, and the loops whose trip
    count could not be read (counted once)."""
    calls = {name: _calls(comps, name) for name in comps}
    order, seen = [], set()

    def visit(name):  # callees after callers (reverse post-order)
        if name in seen or name not in comps:
            return
        seen.add(name)
        for callee, _, _ in calls[name]:
            visit(callee)
        order.append(name)

    visit(entry)
    runs, labels, uncounted = collections.Counter({entry: 1}), {}, []
    for name in reversed(order):
        for callee, times, label in calls[name]:
            if times is None:
                uncounted.append(callee)
            runs[callee] += runs[name] * (1 if times is None else times)
            if label or name in labels:
                labels[callee] = label or labels[name]
    return runs, labels, uncounted


def _window_label(inst: _Instruction) -> str | None:
    """The collective-matmul label of a windowed einsum's while loop; None for other ops."""
    body = inst.attribute("body") if inst.opcode == "while" else None
    return next((label for key, label in _WINDOWED.items() if key in (body or "")), None)


def _loop_edges(insts, by_name) -> dict[str, str]:
    """{collective-permute: label} for the permutes of a windowed einsum outside its loop: the
    shard sent before an all-gather's loop, the partial sum sent after a reduce-scatter's."""
    edges = {}
    for loop in insts:
        label = _window_label(loop)
        if label is None or not loop.operands:
            continue
        if label.startswith("all-gather"):  # a permute whose shard goes into the loop
            init = _through(by_name, loop.operands[0])
            for o in init.operands if init is not None and init.opcode == "tuple" else []:
                inst = _through(by_name, o)
                if inst is not None and inst.opcode.startswith("collective-permute"):
                    edges[inst.name] = label
        else:  # a permute of what the loop gives back
            for inst in insts:
                if inst.opcode in ("collective-permute", "collective-permute-start"):
                    source = _through(by_name, inst.operands[0]) if inst.operands else None
                    if source is not None and source.opcode == "get-tuple-element":
                        source = _through(by_name, source.operands[0])
                    if source is loop:
                        edges[inst.name] = label
    for inst in insts:  # an async permute counts at its -done: label it as its -start
        if inst.opcode == "collective-permute-done" and set(inst.operands[:1]) & edges.keys():
            edges[inst.name] = edges[inst.operands[0]]
    return edges


def _shape_bytes(shape: str) -> int:
    return sum(
        _BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
        for t, dims in _SHAPE.findall(shape)
    )


def collective_bytes(text: str) -> tuple[dict[str, float], list[str]]:
    """{kind: bytes per execution} of the collectives in compiled HLO text, and the bodies of
    the while loops whose trip count could not be read (their collectives are counted once).

    Each collective counts the full array it works on: a reduce-scatter its operand, the others
    their result (an async one at its -done), times the runs of its computation. What XLA:TPU
    writes in other forms is counted as what it is: its fused reduce-scatter (an all-reduce
    sliced) as a reduce-scatter, a gather written as an all-reduce (of zeros but the local
    shard) as "all-gather (as all-reduce)", and the permutes of a windowed einsum's loop as
    "all-gather (collective matmul)" or "reduce-scatter (collective matmul)": FSDP's gathers of
    weights and reductions of gradients.
    """
    comps, entry = _computations(text)
    runs, labels, uncounted = _runs(comps, entry)
    out = collections.Counter()
    for name, insts in comps.items():
        if not runs.get(name):
            continue
        by_name = {i.name: i for i in insts}
        edges = None
        for inst in insts:
            m = _COLLECTIVE.match(inst.opcode)
            if not m or m.group(2) == "-start":
                continue
            kind = m.group(1)
            if kind == "all-reduce" and name.startswith(_REDUCE_SCATTER_FUSION):
                kind = "reduce-scatter"
            if kind == "collective-permute":
                edges = _loop_edges(insts, by_name) if edges is None else edges
                kind = labels.get(name) or edges.get(inst.name) or kind
            done = m.group(2) == "-done"
            start = by_name.get(inst.operands[0]) if done and inst.operands else inst
            operands = start.operands if start is not None else []
            if kind == "reduce-scatter" and m.group(1) == "reduce-scatter":  # the array reduced
                size = sum(_shape_bytes(by_name[o].shape) for o in operands if o in by_name)
                out[kind] += size * runs[name]
            elif kind == "all-reduce":
                for part, size in _all_reduce_parts(inst.shape, operands, by_name, comps):
                    out[part] += size * runs[name]
            else:
                out[kind] += _shape_bytes(inst.shape) * runs[name]
    return dict(out), uncounted


def _all_reduce_parts(shape: str, operands: list[str], by_name: dict, comps: dict):
    """(kind, bytes) for each array an all-reduce sums. XLA:TPU writes some gathers (FSDP's on
    large slices) as an all-reduce of zeros with each device's shard written in its place:
    those count as "all-gather (as all-reduce)"."""
    arrays = _SHAPE.findall(shape)
    if len(arrays) != len(operands):
        return [("all-reduce", _shape_bytes(shape))]
    parts = []
    for (dtype, dims), operand in zip(arrays, operands, strict=True):
        size = _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        gather = _written_into_zeros(_through(by_name, operand), by_name, comps)
        parts.append(("all-gather (as all-reduce)" if gather else "all-reduce", size))
    return parts


def _written_into_zeros(inst: _Instruction | None, by_name: dict, comps: dict) -> bool:
    """Whether `inst` writes a piece into an array of zeros: a dynamic-update-slice of a
    broadcast 0, or a fusion whose root is one."""
    if inst is not None and inst.opcode == "dynamic-update-slice":
        return _is_zeros(_through(by_name, inst.operands[0]), by_name)
    if inst is None or inst.opcode != "fusion":
        return False
    fused = comps.get(inst.attribute("calls")) or []
    in_fusion = {i.name: i for i in fused}
    root = next((i for i in fused if i.root), None)
    if root is None or root.opcode != "dynamic-update-slice":
        return False
    base = _through(in_fusion, root.operands[0])
    if base is not None and base.opcode == "parameter" and base.literal.isdigit():
        outer = inst.operands[int(base.literal)] if int(base.literal) < len(inst.operands) else ""
        return _is_zeros(_through(by_name, outer), by_name)  # the zeros come from outside
    return _is_zeros(base, in_fusion)


def _is_zeros(inst: _Instruction | None, by_name: dict) -> bool:
    """Whether `inst` is a broadcast of the constant 0."""
    if inst is None or inst.opcode != "broadcast" or not inst.operands:
        return False
    value = _through(by_name, inst.operands[0])
    return value is not None and value.opcode == "constant" and value.literal in ("0", "-0")


_DOT = re.compile(
    r"stablehlo\.dot_general .*contracting_dims = \[([\d, ]*)\] x .*"
    r": \(tensor<([\dx]*)x(\w+)>, tensor<[\dx]*x(\w+)>\) -> tensor<([\dx]*)x\w+>"
)


def f32_dot_fraction(stablehlo: str) -> float:
    """Of the matmul FLOPs a lowered program asks for (StableHLO text, before any backend
    rewrites them; loop bodies counted once), the share with a float32 operand: JAX lowers a
    float32 x bf16 matmul for GPUs as a float32 one."""
    flops = {"f32": 0.0, "all": 0.0}
    for m in _DOT.finditer(stablehlo):
        contracting, lhs, lhs_type, rhs_type, out = m.groups()
        lhs_dims = [int(d) for d in lhs.split("x") if d]
        k = math.prod(lhs_dims[int(i)] for i in contracting.split(",") if i.strip())
        f = 2.0 * math.prod(int(d) for d in out.split("x") if d) * k
        flops["all"] += f
        if "f32" in (lhs_type, rhs_type):
            flops["f32"] += f
    return flops["f32"] / flops["all"] if flops["all"] else 0.0


# ------------------------------------------------------------------------------- printing
def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_report(r: Report) -> str:
    lines = [
        f"{r.config or 'config'} on {r.topology or r.devices}: {r.devices}",
        f"  mesh {r.mesh}; {r.per_device_batch:g} train rows per data-parallel device",
        f"  parameters {r.num_params:,}: {_gib(r.param_bytes)} per device; optimizer state "
        f"{_gib(r.opt_bytes)} per device",
        f"  model FLOPs per train step {r.flops_per_step:.3g}; ideal step at peak bf16 "
        f"{1e3 * r.ideal_step_s:.1f} ms (a lower bound, not a measurement)",
    ]
    hbm = r.hbm_bytes
    for s in r.steps:
        if not s.fits:
            need = f"needs {_gib(s.peak_bytes)}" if s.peak_bytes else "needs more than that"
            lines.append(
                f"  {s.name}: DOES NOT FIT: {need}, the chip has {_gib(hbm)} {r.memory_label} "
                f"(compile {s.compile_s:.1f} s){': ' + s.error if s.error else ''}"
            )
            continue
        share = f" = {s.peak_bytes / hbm:.0%} of {_gib(hbm)} {r.memory_label}" if hbm else ""
        coll = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(s.collectives.items())) or "none"
        # every buffer at once, where the compiler's peak is below it (buffers not all live)
        total = f" (all buffers {_gib(s.total_bytes)})"
        total = total if _gib(s.total_bytes) != _gib(s.peak_bytes) and s.total_bytes else ""
        lines.append(
            f"  {s.name}: compile {s.compile_s:.1f} s; arguments {_gib(s.argument_bytes)}, "
            f"temporaries {_gib(s.temp_bytes)}, peak {_gib(s.peak_bytes)}{share}{total}; "
            + (f"offloaded to host memory {_gib(s.host_bytes)}; " if s.host_bytes else "")
            + f"collectives per step: {coll}"
        )
    lines += [f"  warning: {w}" for w in r.warnings]
    if not r.fits:
        lines.append(
            "  To fit: --config.model.remat_policy=dots (or full) recomputes activations, "
            "offload_layer_inputs also keeps layer inputs in host memory; "
            "--config.model.scan_layers=True; --config.num_microbatches=2 halves the "
            "activations per pass; a larger --config.mesh.fsdp shards parameters and "
            "optimizer state over more devices; or a smaller --config.batch_size."
        )
    return "\n".join(lines)
