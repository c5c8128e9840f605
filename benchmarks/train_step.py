r"""Train-step time, throughput and MFU of each model family's shipped config, on this machine.

    python benchmarks/train_step.py [--families=vit,lm,mlm,translate] [--steps=20] [--devices=1]

For each family: the config's model, batch and jitted steps from tfjax.runner.setup.set_up (as
the runner builds them), `train_step` timed on real batches already on the devices, so the
figures are the step alone (the input pipeline runs ahead of it in training). MFU is the model
FLOPs (6 N T + attention, see tfjax.runner.chips) per second over its peak_flops: the
vendor's peak on a known accelerator, else the matmul throughput measured in this same run.
The run also counts compilations: train_step once for all steps, eval_step once for a whole
evaluation epoch, its zero-padded last batch included. Writes benchmarks/results/train_step.json
(or --out).
"""

import itertools
import logging
import os
import statistics
import sys

import harness
from harness import ROOT

FAMILIES = {
    "vit": "configs/vit.py:digits",
    "lm": "configs/lm.py:pydoc",
    "mlm": "configs/mlm.py:pydoc",
    "translate": "configs/translate.py:demo",
}


class CompileCounter(logging.Handler):
    """Counts jax.log_compiles() messages per jitted function name."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling jit("):
            name = message[len("Compiling jit(") : message.index(")")]
            self.counts[name] = self.counts.get(name, 0) + 1


def bench(family, spec, *, steps, devices, data_dir):
    import jax

    import tfjax.data
    from tfjax import sharding
    from tfjax.runner import checks, chips, setup

    config = setup.load_config(os.path.join(ROOT, spec))
    config.data_dir = data_dir or ""
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:devices])
    data_config = tfjax.data.dataset_spec(config)
    if tfjax.data.is_embedded(data_config.name):
        tfjax.data.prepare(data_config.name, data_dir or None)

    def make_loader(split, batch_size, train):  # the runner's: endless shuffled / one epoch
        return tfjax.data.make_loader(
            data_config,
            split=split,
            batch_size=batch_size,
            seed=0,
            shuffle=train,
            num_epochs=None if train else 1,
            data_dir=data_dir or None,
        )

    loader = make_loader(data_config.train_split, config.batch_size, train=True)
    eval_loader = make_loader(data_config.eval_split, config.eval_batch_size, train=False)
    inputs = setup.Inputs.from_loaders(config, data_config, loader, eval_loader)
    exp = setup.set_up(config, mesh, inputs=inputs)
    rules = exp.rules
    state = exp.init(jax.random.key(0))
    step_fn, eval_fn = exp.train_step, exp.eval_step
    key = jax.jit(lambda: jax.random.key(1), out_shardings=exp.replicated)()

    batches = itertools.cycle([sharding.shard_batch(next(loader), mesh, rules) for _ in range(4)])

    def step():
        nonlocal state
        state, stats = step_fn(state, next(batches), key)
        return stats

    counter = CompileCounter()
    logging.getLogger("jax").addHandler(counter)
    with jax.log_compiles():
        first = harness.timed(step)
        times = harness.time_rounds({"train_step": step}, steps, warmup=0)["train_step"]
        eval_batches = 0
        for batch in eval_loader:  # one epoch; the last batch is zero-padded to full size
            jax.block_until_ready(eval_fn(state.params, sharding.shard_batch(batch, mesh, rules)))
            eval_batches += 1
    logging.getLogger("jax").removeHandler(counter)
    loader.close()
    eval_loader.close()

    step_s = statistics.median(times)
    flops = exp.flops_per_step
    peak = chips.peak_flops(mesh, checks.COMPUTE_DTYPES[config.dtype])
    units = exp.task.units_per_batch(loader.element_spec)
    return dict(
        family=family,
        params=exp.num_params,
        batch=config.batch_size,
        first_s=first,
        step_ms=1e3 * step_s,
        rate=units / step_s,
        unit=exp.task.UNIT,
        gflops=flops / 1e9,
        tflops_s=flops / step_s / 1e12,
        peak_tflops_s=peak.flops / 1e12,
        peak_source=peak.source,
        mfu=flops / step_s / peak.flops,
        train_compiles=counter.counts.get("train_step", 0),
        eval_compiles=counter.counts.get("eval_step", 0),
        eval_batches=eval_batches,
    )


def main():
    parser = harness.parser(__doc__, "train_step", tiny=False)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=1, help="devices of the mesh (data=-1)")
    parser.add_argument("--data_dir", default=os.environ.get("TFJAX_DATA_DIR", ""))
    args = parser.parse_args()
    if args.devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import jax

    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {args.devices} device(s), "
        f"{os.cpu_count()} CPU cores"
    )
    rows = [
        bench(f, FAMILIES[f], steps=args.steps, devices=args.devices, data_dir=args.data_dir)
        for f in args.families.split(",")
    ]
    header = (
        f"{'family':10} {'params':>9} {'batch':>5} {'compile+1st s':>13} {'step ms':>8} "
        f"{'throughput':>20} {'GFLOP/step':>10} {'TFLOP/s':>8} {'peak TFLOP/s':>12} "
        f"{'MFU':>6} {'compiles (train, eval/batches)':>30}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['family']:10} {r['params']:>9,} {r['batch']:>5} {r['first_s']:>13.1f} "
            f"{r['step_ms']:>8.1f} {r['rate']:>12,.0f} {r['unit'] + '/s':>7} "
            f"{r['gflops']:>10.2f} {r['tflops_s']:>8.3f} {r['peak_tflops_s']:>12.3f} "
            f"{100 * r['mfu']:>5.1f}% {r['train_compiles']:>14}, "
            f"{r['eval_compiles']}/{r['eval_batches']}"
        )
    for source in dict.fromkeys(r["peak_source"] for r in rows):
        print(f"peak: {source}")
    harness.write_json(
        args.out,
        dict(
            benchmark="train_step", devices=args.devices, machine=harness.machine("jax"), rows=rows
        ),
    )
    bad = [r["family"] for r in rows if r["train_compiles"] != 1 or r["eval_compiles"] != 1]
    if bad:
        sys.exit(f"recompiled: {bad}")


if __name__ == "__main__":
    main()
