"""Lowering and compiling each step of a config ahead of time for a target's devices, and what
the compiler says: memory per device, compile time, a refusal for memory.

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
            backend rewrites its matmuls into library calls (`tfjax.runner.aot.hlo`).
  collectives  `tfjax.runner.aot.collectives`.
"""

from __future__ import annotations

import math
import re
import time

import jax

from tfjax import sharding, tasks
from tfjax.runner import chips, setup
from tfjax.runner.aot.collectives import collective_bytes
from tfjax.runner.aot.hlo import f32_dot_fraction
from tfjax.runner.aot.report import Report, StepReport, gib
from tfjax.runner.aot.topology import usable_memory

FIT_MARGIN = 0.10  # a peak above 90% of HBM is warned about: runtime buffers need room too
LARGE_REPLICATED_BYTES = 256 * 2**20  # a replicated state array above this is warned about


class CompileError(RuntimeError):
    """The target's compiler failed on a step for a reason other than memory."""


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
    warnings += _step_warnings(reports, hbm, memory_label)
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


def _step_warnings(reports: list[StepReport], hbm: int, memory_label: str) -> list[str]:
    """What a compiled step's report asks to look at: a peak close to the memory, collectives
    counted once, matmuls promoted to float32 under bfloat16."""
    warnings = []
    for r in reports:
        if r.fits and hbm and r.peak_bytes > (1 - FIT_MARGIN) * hbm:
            warnings.append(
                f"{r.name} step: peak {gib(r.peak_bytes)} is {r.peak_bytes / hbm:.0%} of the "
                f"{gib(hbm)} {memory_label} (over {1 - FIT_MARGIN:.0%}); runtime buffers may "
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
    return warnings


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
                f"{name} {tuple(leaf.shape)} ({gib(size)}) is replicated on every device: "
                "give it a sharded logical axis or raise mesh.fsdp / mesh.tensor"
            )
    return out
