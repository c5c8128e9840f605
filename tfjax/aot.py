"""Compile an experiment for a TPU slice or a GPU node from a CPU host: fit, memory, FLOPs.

    devices = aot.topology_devices("v5e:4x4", num_slices=2)     # compile-only devices
    report = aot.compile_experiment(config, devices)             # every step of the config
    print(aot.format_report(report))

No data, workdir or accelerator is needed: `tfjax.experiment.set_up` builds the steps the
runner would run, on a mesh of the topology's compile-only devices, with the batch shapes and
vocabulary planned from the config. Each step (train, eval, and decode for generating tasks)
is lowered and compiled by the target's own compiler, and the report gives what a launch would
meet: memory per device against the chip's HBM (`tfjax.chips`), compile time, model FLOPs and
the ideal step time at the chip's peak bf16 rate (a lower bound: no step runs at peak), and the
bytes each kind of collective produces per step.

Measured how:
  memory    XLA's `memory_analysis()` of the compiled program, per device: arguments (state and
            batch), temporaries, and as "peak" the larger of XLA's peak and arguments + outputs
            (less donated) + temporaries, which is what must fit. The TPU compiler itself refuses
            a program over its HBM ("RESOURCE_EXHAUSTED"), naming what it needed.
  FLOPs     tfjax.metrics' count of the model (XLA's `cost_analysis()` counts a loop body once,
            so scanned layers would be undercounted).
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
import time

import jax
import numpy as np

from tfjax import chips, evaluation, experiment, sharding

TPU_FORMS = {  # generation -> how many dimensions its topology names
    "v4": 3,
    "v5e": 2,
    "v5p": 3,
    "v6e": 2,
}
TOPOLOGY_HELP = (
    "v4:AxBxC, v5e:AxB, v5p:AxBxC, v6e:AxB (chips per dimension, e.g. v5e:4x4), with "
    "num_slices for several slices"
)
FIT_MARGIN = 0.10  # a peak above 90% of HBM is warned about: runtime buffers need room too
LARGE_REPLICATED_BYTES = 256 * 2**20  # a replicated state array above this is warned about
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


# ------------------------------------------------------------------------------ the target
def topology_devices(topology: str, *, num_slices: int = 1) -> list:
    """The compile-only devices of a TPU topology ("v5e:4x4"), `num_slices` slices of it.

    Raises ValueError naming the accepted forms before anything is loaded.
    """
    name, _, dims = topology.partition(":")
    name = name.lower()
    sizes = dims.split("x") if dims else []
    if not all(s.isdigit() and int(s) > 0 for s in sizes) or not sizes:
        raise ValueError(f"topology {topology!r} is not understood; accepted: {TOPOLOGY_HELP}")
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}")
    from jax.experimental import topologies

    if name not in TPU_FORMS:
        raise ValueError(
            f"topology {topology!r}: unknown chip {name!r}; accepted: {TOPOLOGY_HELP} (GPU "
            "targets are not supported yet)"
        )
    if len(sizes) != TPU_FORMS[name]:
        raise ValueError(
            f"topology {topology!r}: {name} slices are named with {TPU_FORMS[name]} "
            f"dimensions; accepted: {TOPOLOGY_HELP}"
        )
    # Compile-only use: several processes may load libtpu at once (tests, scripts).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=topology, num_slices=num_slices
        )
    except RuntimeError as e:
        if "not installed" in str(e):
            raise RuntimeError(
                "compiling for a TPU needs libtpu: pip install 'libtpu==0.0.42.*' (or "
                "`pip install -e .[tpu]`)"
            ) from None
        raise
    return list(topo.devices)


# ------------------------------------------------------------------------------ the report
@dataclasses.dataclass
class StepReport:
    name: str  # "train", "eval", "decode"
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int  # max(XLA's peak, arguments + outputs - aliased + temporaries)
    collectives: dict[str, float]  # kind -> bytes per step (result bytes x trip count)
    f32_dot_fraction: float  # of the dot FLOPs, the share with float32 operands
    fits: bool
    error: str = ""  # the compiler's refusal, first line


@dataclasses.dataclass
class Report:
    config: str
    topology: str
    devices: str  # "16 x TPU v5 lite (...)"
    num_devices: int
    hbm_bytes: int  # per device
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
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def compile_experiment(config, devices, *, topology: str = "", name: str = "",
                       steps=None) -> Report:  # fmt: skip
    """Compiles every step of `config` for `devices` (compile-only or real) and reports.

    topology, name: how the report names the target and the config.
    steps: which of "train", "eval", "decode" (default: all that the config has).
    Raises ValueError for a bad config or mesh (naming the field) before compiling anything.
    """
    mesh = sharding.make_mesh(config.mesh, devices)
    inputs = experiment.planned_inputs(config)
    exp = experiment.set_up(config, mesh, inputs=inputs)
    spec = chips.of(devices[0], devices)
    hbm = spec.hbm_bytes if spec else 0
    peak = spec.peak_flops if spec else float("nan")
    state = exp.abstract_state
    param_bytes = _shard_bytes(state.params)
    warnings = _state_warnings(exp)
    wanted = steps or ("train", "eval", "decode")
    lowerings = {
        "train": lambda: exp.train_step.lower(state, exp.train_batch, exp.abstract_rng),
        "eval": lambda: exp.eval_step.lower(state.params, exp.eval_batch),
    }
    if "decode" in wanted and evaluation.decoding(config):
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
                f"{_gib(hbm)} HBM (over {1 - FIT_MARGIN:.0%}); runtime buffers may not fit"
            )
        if r.f32_dot_fraction > 0.05:
            warnings.append(
                f"{r.name} step: {r.f32_dot_fraction:.0%} of the matmul FLOPs take float32 "
                "operands under dtype=bfloat16 (something promotes the compute to float32)"
            )
    dp = sharding.data_parallel_size(mesh, exp.rules)
    return Report(
        config=name, topology=topology,
        devices=chips.describe(devices), num_devices=len(devices), hbm_bytes=hbm,
        peak_flops=peak, mesh=dict(mesh.shape), per_device_batch=config.batch_size / dp,
        num_params=exp.num_params, param_bytes=param_bytes,
        opt_bytes=_shard_bytes(state) - param_bytes, flops_per_step=exp.flops_per_step,
        ideal_step_s=exp.flops_per_step / (len(devices) * peak), steps=reports,
        warnings=warnings,
    )  # fmt: skip


def _lower_decode(exp):
    """The eval-time generation of the runner (`tfjax.evaluation`): translation decodes each
    eval batch as sharded (greedy or beam); an LM continues decode.num_samples prompts of
    decode.prompt_length tokens, taken to the host and replicated."""
    from tfjax import decode

    config, d = exp.config, exp.config.decode
    if evaluation.decoding(config) == "bleu":
        prompts = exp.eval_batch["inputs"]
        max_new = d.max_new_tokens or prompts.shape[1]
        method = d.method if d.method in experiment.DECODE_METHODS else "greedy"
    else:
        tokens = exp.eval_batch["tokens"]
        rows = (min(d.num_samples, tokens.shape[0]), min(d.prompt_length, tokens.shape[1]))
        prompts = jax.ShapeDtypeStruct(rows, tokens.dtype, sharding=exp.replicated)
        max_new = min(d.max_new_tokens or 32, exp.model.max_len - rows[1])
        method = d.method
    with sharding.logical_context(exp.mesh, exp.rules):
        return decode.lower(
            exp.model, exp.abstract_state.params, prompts, max_new_tokens=max_new, eos_id=2,
            method=method, beam_size=d.beam_size, alpha=d.alpha, temperature=d.temperature,
            top_k=d.top_k, top_p=d.top_p,
        )  # fmt: skip


def _compile_step(name, lower, *, hbm: int, bf16: bool) -> StepReport:
    start = time.perf_counter()
    try:
        compiled = lower().compile()
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory refusal is kept
        message = str(e)
        if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
            raise
        used = _refused_bytes(message)
        return StepReport(name, time.perf_counter() - start, 0, 0, 0, 0, used, {}, 0.0,
                          fits=False, error=_first_line(message))  # fmt: skip
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    # The larger of XLA's peak and everything allocated at once: TPU's peak can be below the
    # temporaries alone, and its compiler refuses a program by its temporaries.
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)  # fmt: skip
    peak = max(getattr(m, "peak_memory_in_bytes", 0), total)
    text = compiled.as_text()
    return StepReport(
        name, seconds, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
        m.temp_size_in_bytes, peak, collective_bytes(text),
        f32_dot_fraction(text) if bf16 else 0.0, fits=not hbm or peak <= hbm,
    )  # fmt: skip


def _first_line(message: str) -> str:
    for line in message.splitlines():
        if line.strip():
            return line.strip()[:400]
    return message[:400]


def _refused_bytes(message: str) -> int:
    """The bytes a refused program needs, from the TPU compiler's message ("the total memory
    required for HLO temporaries (20.00G) exceeds available HBM (15.75G)", or "Used 17.25G of
    15.25G hbm"); 0 when it gives none."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    for pattern in (r"required for [^(]*\(([\d.]+)([KMGT])\) exceeds",
                    r"Used ([\d.]+)([KMGT]) of [\d.]+[KMGT] hbm"):  # fmt: skip
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
        size = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
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
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}  # fmt: skip


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
        for callee in re.findall(r"(?:calls|branch_computations|called_computations)="
                                 r"\{?([%\w.\-, ]+)\}?", line):  # fmt: skip
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


def f32_dot_fraction(text: str) -> float:
    """Of the dot FLOPs in compiled HLO text (loops counted once), the share whose operands
    are both float32."""
    flops = {"f32": 0.0, "all": 0.0}
    for line in text.splitlines():
        if " dot(" not in line:
            continue
        shapes = _SHAPE.findall(line)
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        if len(shapes) < 3 or not contracting:
            continue
        out_elems = math.prod(int(d) for d in shapes[0][1].split(",") if d)
        lhs_dims = [int(d) for d in shapes[1][1].split(",") if d]
        k = math.prod(lhs_dims[int(i)] for i in contracting.group(1).split(",") if i)
        f = 2.0 * out_elems * k
        flops["all"] += f
        if shapes[1][0] == "f32" and shapes[2][0] == "f32":
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
                f"  {s.name}: DOES NOT FIT: {need}, the chip has {_gib(hbm)} "
                f"(compile {s.compile_s:.1f} s){': ' + s.error if s.error else ''}"
            )
            continue
        share = f" = {s.peak_bytes / hbm:.0%} of {_gib(hbm)} HBM" if hbm else ""
        coll = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(s.collectives.items())) or "none"
        lines.append(
            f"  {s.name}: compile {s.compile_s:.1f} s; arguments {_gib(s.argument_bytes)}, "
            f"temporaries {_gib(s.temp_bytes)}, peak {_gib(s.peak_bytes)}{share}; "
            f"collectives per step: {coll}"
        )
    lines += [f"  warning: {w}" for w in r.warnings]
    if not r.fits:
        lines.append(
            "  To fit: --config.model.remat_policy=dots (or full) recomputes activations; "
            "--config.model.scan_layers=True; --config.num_microbatches=2 halves the "
            "activations per pass; a larger --config.mesh.fsdp shards parameters and "
            "optimizer state over more devices; or a smaller --config.batch_size."
        )
    return "\n".join(lines)
