"""What a compile finds: a report per step (memory, compile time, collectives) and for the
whole config (devices, mesh, parameters, FLOPs, warnings), and its printed form."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepReport:
    name: str  # "train", "eval", "decode"
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int  # of HBM, what must fit (see aot.compile's docstring): TPU, XLA's peak
    collectives: dict[str, float]  # kind -> bytes per step (aot.collectives.collective_bytes)
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


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_report(r: Report) -> str:
    lines = [
        f"{r.config or 'config'} on {r.topology or r.devices}: {r.devices}",
        f"  mesh {r.mesh}; {r.per_device_batch:g} train rows per data-parallel device",
        f"  parameters {r.num_params:,}: {gib(r.param_bytes)} per device; optimizer state "
        f"{gib(r.opt_bytes)} per device",
        f"  model FLOPs per train step {r.flops_per_step:.3g}; ideal step at peak bf16 "
        f"{1e3 * r.ideal_step_s:.1f} ms (a lower bound, not a measurement)",
    ]
    hbm = r.hbm_bytes
    for s in r.steps:
        if not s.fits:
            need = f"needs {gib(s.peak_bytes)}" if s.peak_bytes else "needs more than that"
            lines.append(
                f"  {s.name}: DOES NOT FIT: {need}, the chip has {gib(hbm)} {r.memory_label} "
                f"(compile {s.compile_s:.1f} s){': ' + s.error if s.error else ''}"
            )
            continue
        share = f" = {s.peak_bytes / hbm:.0%} of {gib(hbm)} {r.memory_label}" if hbm else ""
        coll = ", ".join(f"{k} {gib(v)}" for k, v in sorted(s.collectives.items())) or "none"
        # every buffer at once, where the compiler's peak is below it (buffers not all live)
        total = f" (all buffers {gib(s.total_bytes)})"
        total = total if gib(s.total_bytes) != gib(s.peak_bytes) and s.total_bytes else ""
        lines.append(
            f"  {s.name}: compile {s.compile_s:.1f} s; arguments {gib(s.argument_bytes)}, "
            f"temporaries {gib(s.temp_bytes)}, peak {gib(s.peak_bytes)}{share}{total}; "
            + (f"offloaded to host memory {gib(s.host_bytes)}; " if s.host_bytes else "")
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
