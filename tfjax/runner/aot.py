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
            batch), temporaries, and as "peak" the larger of XLA's peak and arguments + outputs
            (less donated) + temporaries, which is what must fit. The TPU compiler itself refuses
            a program over its HBM ("RESOURCE_EXHAUSTED"), naming what it needed; the GPU
            compiler does not, so tfjax compares the peak with the share of GPU memory JAX
            allocates from (75% unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise).
  FLOPs     tfjax.runner.chips' count of the model (XLA's `cost_analysis()` counts a loop body
            once, so scanned layers would be undercounted, and gives nothing for GPUs). The float32
            share of matmul FLOPs is read from the program as lowered (StableHLO), before a
            backend rewrites its matmuls into library calls.
  collectives  each all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute
            of the compiled HLO: its result bytes times the trip count of the loops around it
            (read from each while loop's condition). Async collectives that the compiler splits
            into pieces count once per piece, so treat the figure as an estimate.
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
    "or h100:HxN (H hosts of N GPUs)"
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
    peak_bytes: int  # of HBM: max(XLA's peak, arguments + outputs - aliased + temporaries)
    collectives: dict[str, float]  # kind -> bytes per step (result bytes x trip count)
    f32_dot_fraction: float  # of the matmul FLOPs, the share with a float32 operand
    fits: bool
    error: str = ""  # the compiler's refusal, first line
    host_bytes: int = 0  # temporaries placed in host memory (remat policies that offload)


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
    config, devices, *, topology: str = "", name: str = "", steps=None
) -> Report:
    """Compiles every step of `config` for `devices` (compile-only or real) and reports.

    topology, name: how the report names the target and the config.
    steps: which of "train", "eval", "decode" (default: all that the config has).
    Raises ValueError for a bad config or mesh (naming the field) before compiling anything.
    """
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
        lowerings["decode"] = lambda: _lower_decode(exp)
    reports = [
        _compile_step(name, lower, hbm=hbm, bf16=config.dtype == "bfloat16")
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
        if r.f32_dot_fraction > 0.05:
            warnings.append(
                f"{r.name} step: {r.f32_dot_fraction:.0%} of the matmul FLOPs take a float32 "
                "operand under dtype=bfloat16 (something promotes the compute to float32)"
            )
    dp = sharding.data_parallel_size(mesh, exp.rules)
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
    )


def _lower_decode(exp):
    """The eval-time generation of the runner (`tfjax.runner.evaluation`): the task's decode-eval
    hook says what it generates from the abstract eval batch (`DecodeEval.generate_args`)."""
    from tfjax import decode

    prompts, kwargs = tasks.decode_eval(exp.config).generate_args(exp, exp.eval_batch)
    with sharding.logical_context(exp.mesh, exp.rules):
        return decode.lower(exp.model, exp.abstract_state.params, prompts, eos_id=2, **kwargs)


def _compile_step(name, lower, *, hbm: int, bf16: bool) -> StepReport:
    lowered = lower()
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory refusal is kept
        message = str(e)
        if not refused_for_memory(message):
            raise CompileError(f"{name} step: the compiler failed: {first_line(message)}") from e
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
    # The larger of XLA's peak and everything allocated at once: TPU's peak can be below the
    # temporaries alone, and its compiler refuses a program by its temporaries.
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    host = getattr(m, "host_temp_size_in_bytes", 0) or 0
    # XLA's peak counts buffers offloaded to host memory with HBM's: with any, the total is
    # HBM's figure.
    peak = total if host else max(getattr(m, "peak_memory_in_bytes", 0), total)
    return StepReport(
        name,
        seconds,
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
        m.temp_size_in_bytes,
        peak,
        collective_bytes(compiled.as_text()),
        f32_dot_fraction(lowered.as_text()) if bf16 else 0.0,
        fits=not hbm or peak <= hbm,
        host_bytes=host,
    )


def refused_for_memory(message: str) -> bool:
    """Whether a compiler's error message is its refusal of a program over the chip's memory."""
    return "RESOURCE_EXHAUSTED" in message or "Ran out of memory" in message


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
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
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


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _trip_count(condition: list[str]) -> int:
    """A scan's while condition compares its counter with one integer constant."""
    constants = [int(c) for line in condition for c in re.findall(r"constant\((\d+)\)", line)]
    return max(constants) if constants else 1


def _multiplicities(comps, entry) -> dict[str, int]:
    """How many times each computation runs per execution of the entry (loops multiply)."""
    mult = collections.Counter({entry: 1})
    order, seen = [], set()

    def visit(name):  # callees after callers (reverse post-order)
        if name in seen or name not in comps:
            return
        seen.add(name)
        for callee, _ in _callees(comps, name):
            visit(callee)
        order.append(name)

    visit(entry)
    for name in reversed(order):
        for callee, times in _callees(comps, name):
            mult[callee] += mult[name] * times
    return mult


def _callees(comps, name):
    for line in comps[name]:
        if " while(" in line:
            body = re.search(r"body=%?([\w.\-]+)", line)
            cond = re.search(r"condition=%?([\w.\-]+)", line)
            trips = _trip_count(comps.get(cond.group(1), [])) if cond else 1
            if body:
                yield body.group(1), trips
            continue
        for callee in re.findall(
            r"(?:calls|branch_computations|called_computations)="
            r"\{?([%\w.\-, ]+)\}?",
            line,
        ):
            for c in callee.split(","):
                yield c.strip().lstrip("%"), 1


def _result_bytes(line: str) -> int:
    """Bytes of an instruction's result (the shapes before its `=`... opcode)."""
    lhs = line.split("=", 1)[1] if "=" in line else line
    head = re.split(r"\s(?:" + "|".join(COLLECTIVES) + r")(?:-start)?\(", lhs, maxsplit=1)[0]
    return sum(
        _BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
        for t, dims in _SHAPE.findall(head)
    )


def collective_bytes(text: str) -> dict[str, float]:
    """{kind: result bytes per execution} of the collectives in compiled HLO text."""
    comps, entry = _computations(text)
    mult = _multiplicities(comps, entry)
    out = collections.Counter()
    pattern = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
    for name, lines in comps.items():
        for line in lines:
            m = pattern.search(line)
            if m and mult.get(name):
                out[m.group(1)] += _result_bytes(line) * mult[name]
    return dict(out)


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
        lines.append(
            f"  {s.name}: compile {s.compile_s:.1f} s; arguments {_gib(s.argument_bytes)}, "
            f"temporaries {_gib(s.temp_bytes)}, peak {_gib(s.peak_bytes)}{share}; "
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
