r"""Each remat policy's peak memory, host (offloaded) memory and FLOPs for one train step,
compiled for a TPU slice from this CPU host (libtpu's compiler; no TPU is used or needed).

    .venv/bin/python benchmarks/remat_policies.py [--config=configs/lm.py:gpt2-xl]
        [--topology=v5p:4x4x4] [--policies=none,full,...]

For every policy of tfjax.nn.blocks.REMAT_POLICIES (all of them unless --policies) the config's
train step is compiled twice over:
  memory  the config as it is (gpt2-xl: 48 scanned layers), `memory_analysis()` per device:
          HBM = arguments + outputs (less donated) + temporaries; host = the temporaries XLA
          placed in host memory (what the offload policies move there; each byte crosses the
          host link twice per step, out in the forward pass and back in the backward pass).
          XLA's own `peak_memory_in_bytes` (kept in the JSON as xla_peak_bytes) is not used:
          for a TPU program with offloaded buffers it counts those host buffers too (a scan of
          16 layers offloading 640 MiB: peak 904 MiB = arguments + outputs + the 640 MiB of
          host buffers, while its HBM allocations total 473 MiB). A program over the chip's
          HBM is refused by the TPU compiler; its row gives what the compiler said it needed.
  FLOPs   XLA's `cost_analysis()` of the compiled step (per device). It counts a loop body once,
          so a scanned stack would show one layer whatever the depth: the step is compiled
          unrolled (scan_layers=False) with 1 and with 2 layers instead, and
              step FLOPs(L) = F(1) + (L - 1) * (F(2) - F(1))
          which is exact for a stack of identical layers (F(2) - F(1) is one layer's forward,
          recomputation and backward). "layer" is F(2) - F(1), the part remat changes.
Ratios are to the "none" policy of the same run. Results go to
benchmarks/results/remat_policies.json or --out (only for the default config, topology and
policies) and a Markdown table to stdout.
"""

import json
import os
import sys
import time

import harness
import jax
from harness import ROOT

from tfjax import sharding
from tfjax.nn.blocks import REMAT_POLICIES
from tfjax.runner import aot, chips, setup

DEFAULT_CONFIG = "configs/lm.py:gpt2-xl"
DEFAULT_TOPOLOGY = "v5p:4x4x4"
GiB = 2**30


def size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def load(spec: str, **model_fields):
    config = setup.load_config(spec)
    with config.unlocked():
        config.model.update(model_fields)
    return config


def compile_train(config, devices):
    """The compiled train step of `config` on a mesh of `devices`, and its compile seconds."""
    mesh = sharding.make_mesh(config.mesh, devices)
    exp = setup.set_up(config, mesh, inputs=setup.planned_inputs(config))
    lowered = exp.train_step.lower(exp.abstract_state, exp.train_batch, exp.abstract_rng)
    start = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - start


def memory(spec: str, policy: str, devices) -> dict:
    config = load(spec, remat_policy=policy)
    try:
        compiled, seconds = compile_train(config, devices)
    except Exception as e:  # noqa: BLE001 - the TPU compiler's refusal of a program over HBM
        message = str(e)
        if not aot.refused_for_memory(message):
            raise
        return {
            "fits": False,
            "peak_bytes": aot.refused_bytes(message),
            "host_bytes": None,
            "error": aot.first_line(message),
        }
    m = compiled.memory_analysis()
    return {
        "fits": True,
        "compile_s": seconds,
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
        "peak_bytes": m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes,
        "xla_peak_bytes": m.peak_memory_in_bytes,
        "host_bytes": m.host_temp_size_in_bytes + m.host_argument_size_in_bytes,
    }


def flops(spec: str, policy: str, devices) -> dict:
    """Per-device FLOPs of the step with 1 and 2 unrolled layers (see the module docstring)."""
    f = []
    for layers in (1, 2):
        config = load(spec, remat_policy=policy, scan_layers=False, num_layers=layers)
        compiled, _ = compile_train(config, devices)
        f.append(compiled.cost_analysis()["flops"])
    return {"flops_1_layer": f[0], "flops_per_layer": f[1] - f[0]}


def main():
    parser = harness.parser(__doc__, "remat_policies", tiny=False)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--topology", default=DEFAULT_TOPOLOGY, help=aot.TOPOLOGY_HELP)
    parser.add_argument("--policies", default=",".join(REMAT_POLICIES))
    args = parser.parse_args()
    os.chdir(ROOT)  # config paths are relative to the checkout
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in REMAT_POLICIES]
    if unknown or "none" not in policies:
        parser.error(f"--policies must name 'none' and only {tuple(REMAT_POLICIES)}; got {unknown}")
    devices = aot.topology_devices(args.topology)
    config = setup.load_config(args.config)
    num_layers = setup.build_model(config, vocab_size=1).num_layers
    hbm = aot.usable_memory(chips.of(devices[0], devices))[0]
    start = time.perf_counter()
    rows = []
    for policy in policies:
        row = {"policy": policy, **memory(args.config, policy, devices)}
        row.update(flops(args.config, policy, devices))
        row["step_flops"] = row["flops_1_layer"] + (num_layers - 1) * row["flops_per_layer"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    none = next(r for r in rows if r["policy"] == "none")
    # Memory against "full" (the paper presets' policy) when "none" does not fit.
    fitting = [r for r in rows if r["fits"] and r["policy"] in ("none", "full")]
    base = fitting[0] if fitting else None
    attention = config.model.get("implementation") or "the target's choice"
    print(
        f"\n{args.config} train step on {args.topology} ({len(devices)} devices, "
        f"{hbm / GiB:.0f} GiB HBM each), {num_layers} layers, attention: {attention}; memory "
        "per device; FLOPs from unrolled 1- and 2-layer compiles\n"
    )
    vs = f"vs {base['policy']}" if base else "ratio"
    print(
        f"| remat_policy | HBM peak | {vs} | host memory (offloaded) | step FLOPs vs none | "
        "layer FLOPs vs none |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        peak = (
            size(r["peak_bytes"]) if r["fits"] else f"does not fit: needs {size(r['peak_bytes'])}"
        )
        ratio = f"{r['peak_bytes'] / base['peak_bytes']:.2f}" if base and r["fits"] else "-"
        host = "-" if r["host_bytes"] is None else size(r["host_bytes"])
        print(
            f"| {r['policy']} | {peak} | {ratio} | {host} | "
            f"{r['step_flops'] / none['step_flops']:.3f} | "
            f"{r['flops_per_layer'] / none['flops_per_layer']:.3f} |"
        )
    seconds = time.perf_counter() - start
    print(f"\n{len(rows)} policies in {seconds:.0f} s")
    if (args.config, args.topology, policies) == (
        DEFAULT_CONFIG,
        DEFAULT_TOPOLOGY,
        list(REMAT_POLICIES),
    ):
        harness.write_json(
            args.out,
            {
                "config": args.config,
                "topology": args.topology,
                "num_devices": len(devices),
                "hbm_bytes": hbm,
                "num_layers": num_layers,
                "attention": attention,
                "jax": jax.__version__,
                "libtpu": harness.version("libtpu"),
                "wall_s": seconds,
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
