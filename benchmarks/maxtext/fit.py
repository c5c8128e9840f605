r"""Llama 3.1 8B's train step, tfjax's and MaxText 0.2.5's, compiled for the same TPU v5p:2x2x2
slice by the same libtpu in one process: peak memory, memory per extra row, largest batch.

    benchmarks/maxtext/setup.sh /path/to/python3.12      # once: benchmarks/maxtext/.venv
    flock /tmp/tpu-compile.lock benchmarks/maxtext/.venv/bin/python benchmarks/maxtext/fit.py \
        --seq_len=8192 --recipe=full [--rows=1] [--max_rows=64] [--only=tfjax|maxtext]

It runs only in that virtualenv (MaxText needs Python 3.12 and its own jax 0.12.0.1 and libtpu
0.0.50.1; tfjax is installed there editable from this checkout) and refuses to start elsewhere;
CI never runs it, and `make bench` does not sweep this folder. Nothing is downloaded: both
steps are compiled from shapes (MaxText with its synthetic dataset, no tokenizer).

Both sides: FSDP over the 8 chips, bf16 compute with float32 parameters, AdamW, scanned
layers, splash attention (MaxText's "flash"), --rows rows of --seq_len tokens per chip.
--recipe says what else:
  full   remat "full" and full logits on both sides.
  tuned  MaxText's tuned Llama 3.1 8B recipe (its benchmarks' llama3_1_8b_8192, written for
         v6e: remat_policy=custom with the decoder layer inputs and the q/k/v/out projections
         offloaded to host memory, 2,048-blocks for splash with the fused backward kernel, iota
         embedding) against tfjax's best levers: loss.chunks=8 and the offload_layer_inputs
         remat policy. The recipe's LIBTPU_INIT_ARGS (scheduler and collective tuning) are not
         set; put them in the environment to give them to both compiles alike. Its 2,048
         blocks need its VMEM limit (--xla_tpu_scoped_vmem_limit_kib=98304): without it
         libtpu refuses every batch with CompileTimeScopedVmemOom (a compiler failure that
         names the flag, not "does not fit": tfjax.runner.aot.refused_for_memory).
--set key=value adds tfjax config fields, --maxtext key=value MaxText ones (after the recipe's).

Each side is the search of benchmarks/batch_fit.py: compiles at --rows and 2 x --rows for the
slope, then bisection up to --max_rows on the compiler's verdict (libtpu refuses a program
over HBM). tfjax's step goes through `tfjax.runner.aot.compile_experiment`; MaxText's is built
with MaxText's own train_compile functions (shaped state, shardings, train_step) and compiled
by the same `aot` step compiler, so both peaks are read alike: XLA's peak (memory_analysis's
peak_memory_in_bytes), or arguments + outputs - aliased + temporaries when buffers are
offloaded to the host (XLA's peak counts those with HBM's). tfjax runs first: MaxText changes
some of jax's global settings as it builds its mesh. The last lines print both sides and the
ratios tfjax / MaxText; results go to benchmarks/results/maxtext_fit_<seq_len>_<recipe>.json.
"""

import importlib.util
import os
import sys
import time

# Compile-only: the host computes nothing, and must not try to start a TPU backend of its own.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
SETUP = os.path.relpath(os.path.join(HERE, "setup.sh"))
if sys.version_info < (3, 12) or importlib.util.find_spec("maxtext") is None:
    raise SystemExit(
        f"{os.path.relpath(__file__)} runs only in MaxText's virtualenv (Python 3.12, MaxText "
        f"0.2.5 with tfjax editable; never in CI): make it with `{SETUP} PYTHON3.12`, then run "
        f"{os.path.relpath(os.path.join(HERE, '.venv/bin/python'))} {os.path.relpath(__file__)}"
    )
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: the harness and batch_fit

import batch_fit  # noqa: E402
import harness  # noqa: E402
from harness import RESULTS, ROOT, log  # noqa: E402

from tfjax.runner import aot, chips  # noqa: E402

GiB = 2**30
TOPOLOGY = "v5p:2x2x2"  # tfjax's name of the slice
MAXTEXT_TOPOLOGY = "v5p-16"  # MaxText's (cores: 2 a chip)
TFJAX_CONFIG = "configs/lm.py:modern-small"
TFJAX_MODEL = ["model.variant=llama-3.1-8b", "model.vocab_size=128256"]
MAXTEXT_MODEL = {
    "model_name": "llama3.1-8b",
    "compile_topology": MAXTEXT_TOPOLOGY,
    "compile_topology_num_slices": 1,
    "ici_fsdp_parallelism": -1,  # all 8 chips
    "attention": "flash",  # splash on a TPU
    "dataset_type": "synthetic",
    "enable_checkpointing": False,
    "skip_jax_distributed_system": True,
    "base_output_directory": "/tmp/maxtext_fit",
    "run_name": "maxtext_fit",
    # MaxText dumps the train step's HLO for every compile (its XLA_FLAGS unless set): here.
    "dump_hlo_local_dir": "/tmp/maxtext_fit/xla_dump/",
}
RECIPES = {  # recipe -> (tfjax --set fields, MaxText overrides)
    "full": ([], {"remat_policy": "full"}),
    "tuned": (
        ["loss.chunks=8", "model.remat_policy=offload_layer_inputs"],
        {
            "remat_policy": "custom",
            "decoder_layer_input": "offload",
            "query_proj": "offload",
            "key_proj": "offload",
            "value_proj": "offload",
            "out_proj": "offload",
            "use_iota_embed": True,
            **{
                f"sa_block_{b}": 2048
                for b in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute")
                + ("q_dq", "kv_dq")
            },
            "sa_use_fused_bwd_kernel": True,
        },
    ),
}


def maxtext_lowered(overrides: dict):
    """MaxText's train step lowered for the slice with `overrides` (its config's key=value), the
    way its train_compile.py builds it: shaped state and batch, its shardings, its train_step."""
    import jax
    from flax.core.spmd import logical_axis_rules
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    base = os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")
    config = pyconfig.initialize(["fit", base, *(f"{k}={v}" for k, v in overrides.items())])
    train_compile.validate_config(config)
    prng = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", "unsafe_rbg")  # as train_compile sets it
    try:
        mesh = train_compile.get_topology_mesh(config)
        args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
        params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
            config, state_shardings
        )
        state_in = sharding.build_zero1_input_state_mesh_shardings(
            config, state_shardings, params_shardings
        )
        data = sharding.get_input_data_sharding(config, mesh)
        step, ins, outs, static, donate = maxtext_utils.get_functional_train_with_signature(
            train.train_step, data, state_in, model, config, params_shardings
        )
        with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
            jitted = jax.jit(
                step,
                in_shardings=ins,
                out_shardings=outs,
                static_argnums=static,
                donate_argnums=donate,
            )
            return jitted.lower(*args, **kwargs)
    finally:
        jax.config.update("jax_default_prng_impl", prng)


def maxtext_measure(overrides: dict, rows: int, hbm: int) -> dict:
    """MaxText's step at `rows` per chip, compiled as aot compiles tfjax's: batch_fit's row."""
    start = time.perf_counter()
    lowered = maxtext_lowered({**overrides, "per_device_batch_size": rows})
    train = aot._compile_step("train", lambda: lowered, hbm=hbm, bf16=True, gpu=False)
    return batch_fit.record(rows, train, time.perf_counter() - start, "maxtext: ")


def side_by_side(found: dict) -> list[str]:
    """The table's lines (and the ratios tfjax / MaxText where both sides ran)."""
    start_rows = next(iter(found.values()))["tried"][0]["rows"]
    peak = f"peak at {start_rows} rows"
    lines = [f"{'':10}{peak:>17}{'per extra row':>15}{'largest batch':>15}"]
    for name, f in found.items():
        start = f["tried"][0]
        slope = f["slope_bytes_per_row"]
        at_least = ">= " if f["capped_by_max_rows"] else ""
        lines.append(
            f"{name:10}{start['peak_bytes'] / GiB:>13.2f} GiB"
            f"{'-' if slope is None else f'{slope / GiB:.2f} GiB':>15}"
            f"{at_least + str(f['largest_rows']):>15}"
        )
    if len(found) == 2:  # both sides ran
        t, m = found["tfjax"], found["maxtext"]
        lines.append(
            harness.ratio_line(
                "peak tfjax/maxtext", t["tried"][0]["peak_bytes"] / m["tried"][0]["peak_bytes"]
            )
        )
        if t["slope_bytes_per_row"] and m["slope_bytes_per_row"]:
            lines.append(
                harness.ratio_line(
                    "per-row tfjax/maxtext", t["slope_bytes_per_row"] / m["slope_bytes_per_row"]
                )
            )
        lines.append(
            harness.ratio_line("largest batch tfjax/maxtext", t["largest_rows"] / m["largest_rows"])
        )
    return lines


def main():
    parser = harness.parser(__doc__, "maxtext_fit", tiny=False)
    parser.set_defaults(out=None)
    parser.add_argument("--seq_len", type=int, default=8192, help="tokens a row")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="full")
    parser.add_argument("--rows", type=int, default=None, help="rows a chip for the slope")
    parser.add_argument("--max_rows", type=int, default=64, help="the bisection's upper bound")
    parser.add_argument("--only", choices=("tfjax", "maxtext"), help="one side only")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="tfjax key=value")
    parser.add_argument(
        "--maxtext", action="append", default=[], help="MaxText key=value (its config)"
    )
    args = parser.parse_args()
    rows = args.rows or max(1, 8192 // args.seq_len)  # 4 at 2,048, 1 at 8,192
    if not 0 < rows < args.max_rows:
        parser.error(f"--rows={rows} must be > 0 and below --max_rows={args.max_rows}")
    for item in args.maxtext:
        if "=" not in item:
            parser.error(f"--maxtext={item}: expected key=value")
    out = args.out or os.path.join(RESULTS, f"maxtext_fit_{args.seq_len}_{args.recipe}.json")

    tfjax_sets, maxtext_recipe = RECIPES[args.recipe]
    sets = TFJAX_MODEL + [f"dataset.seq_len={args.seq_len}"] + tfjax_sets + args.sets
    overrides = {
        **MAXTEXT_MODEL,
        "max_target_length": args.seq_len,
        **maxtext_recipe,
        **dict(item.split("=", 1) for item in args.maxtext),
    }
    devices = aot.topology_devices(TOPOLOGY)  # also sets up libtpu's environment for MaxText
    hbm = aot.usable_memory(chips.of(devices[0], devices))[0]
    sides = {}  # name -> (measure(rows), data-parallel chips)
    if args.only in (None, "tfjax"):
        config = batch_fit.load(TFJAX_CONFIG, sets)
        dp = batch_fit.data_parallel_devices(config, devices)
        log(f"tfjax: {TFJAX_CONFIG} {' '.join(sets)} on {TOPOLOGY}: {dp} data-parallel chips")
        sides["tfjax"] = (
            lambda r: batch_fit.measure(config, r, dp, devices, TOPOLOGY, "tfjax: "),
            dp,
        )
    if args.only in (None, "maxtext"):
        sides["maxtext"] = (lambda r: maxtext_measure(overrides, r, hbm), len(devices))
    found, failed = {}, {}
    for name, (measure, data_parallel) in sides.items():
        if name == "maxtext":
            log(f"maxtext: {' '.join(f'{k}={v}' for k, v in overrides.items())}")
        try:
            found[name] = batch_fit.search(
                measure, rows, args.max_rows, hbm, data_parallel, f"{name}: "
            )
        except (aot.CompileError, SystemExit) as e:
            # A compiler failure (not a verdict on memory), or --rows refused: said, and the
            # other side still runs.
            log(f"{name}: {e}")
            failed[name] = str(e)
    log(f"\n{args.seq_len}-token rows, recipe {args.recipe}, {TOPOLOGY}, HBM {hbm / GiB:.2f} GiB")
    for line in side_by_side(found) if found else []:
        log(line)
    harness.write_json(
        out,
        {
            "benchmark": "maxtext_fit",
            "seq_len": args.seq_len,
            "recipe": args.recipe,
            "topology": TOPOLOGY,
            "hbm_bytes": hbm,
            "tfjax_config": TFJAX_CONFIG,
            "tfjax_sets": sets,
            "maxtext_overrides": overrides,
            **found,
            "failed": failed,
            "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
            "command": " ".join([os.path.relpath(sys.executable, ROOT)] + sys.argv),
            "machine": harness.machine("jax", "jaxlib", "libtpu", "flax", "maxtext"),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
