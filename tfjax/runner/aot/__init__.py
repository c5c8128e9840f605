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

The modules (each docstring says how its figures are taken):
  topology     the target's devices (`topology_devices`, TOPOLOGY_HELP) and the memory a program
               may use on one (`usable_memory`)
  compile      `compile_experiment`: each step lowered and compiled, memory and FLOPs read, the
               compiler's refusals read (`refused_for_memory`, `refused_bytes`, CompileError)
  report       Report, StepReport and `format_report`
  hlo          reading compiled HLO text: computations, loop trip counts, shape bytes; the float32
               share of a lowered program's matmuls (`f32_dot_fraction`)
  collectives  `collective_bytes`: the bytes each kind of collective produces per step
"""

from tfjax.runner.aot.collectives import COLLECTIVES, collective_bytes
from tfjax.runner.aot.compile import (
    FIT_MARGIN,
    LARGE_REPLICATED_BYTES,
    CompileError,
    _compile_step,  # noqa: F401 - benchmarks/maxtext/fit.py compiles a step of its own
    compile_experiment,
    first_line,
    refused_bytes,
    refused_for_memory,
    vmem_hint,
)
from tfjax.runner.aot.hlo import f32_dot_fraction
from tfjax.runner.aot.report import Report, StepReport, format_report
from tfjax.runner.aot.topology import (
    GPU_MEM_FRACTION_DEFAULT,
    TOPOLOGY_HELP,
    TPU_FORMS,
    gpu_target_config,
    platform_of,
    topology_devices,
    usable_memory,
)

__all__ = [
    "COLLECTIVES",
    "FIT_MARGIN",
    "GPU_MEM_FRACTION_DEFAULT",
    "LARGE_REPLICATED_BYTES",
    "TOPOLOGY_HELP",
    "TPU_FORMS",
    "CompileError",
    "Report",
    "StepReport",
    "collective_bytes",
    "compile_experiment",
    "f32_dot_fraction",
    "first_line",
    "format_report",
    "gpu_target_config",
    "platform_of",
    "refused_bytes",
    "refused_for_memory",
    "topology_devices",
    "usable_memory",
    "vmem_hint",
]
