r"""Train-step time, throughput and MFU of each model family's shipped config, on this machine.

    python benchmarks/train_step.py [--families=vit,lm,mlm,translate] [--steps=20] [--devices=1]

For each family: the config's model and batch, a jitted `train_step` (as tfjax.train builds it)
timed on real batches already on the devices, so the figures are the step alone (the input
pipeline runs ahead of it in training). MFU is the model FLOPs (6 N T + attention, see
tfjax.metrics) per second over the matmul throughput measured in this same run. The run also
counts compilations: train_step once for all steps, eval_step once for a whole evaluation
epoch, its zero-padded last batch included.
"""

import argparse
import logging
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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
    from tfjax import metrics, optim, sharding, tasks, train

    config = train.load_config(os.path.join(ROOT, spec))
    config.data_dir = data_dir or ""
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:devices])
    rules = sharding.check_rules(config.logical_axis_rules)
    task = tasks.get(config.task)
    data_config = tfjax.data.resolve_config(dict(config.dataset))
    if data_config.name in tfjax.data.embedded.BUILDERS:
        tfjax.data.prepare(data_config.name, data_dir or None)
    loader = tfjax.data.make_loader(data_config, split=data_config.train_split,
                                    batch_size=config.batch_size, seed=0, shuffle=True,
                                    num_epochs=None, data_dir=data_dir or None)  # fmt: skip
    eval_loader = tfjax.data.make_loader(data_config, split=data_config.eval_split,
                                         batch_size=config.eval_batch_size, seed=0,
                                         shuffle=False, num_epochs=1,
                                         data_dir=data_dir or None)  # fmt: skip
    tok = loader.tokenizer
    model = train.build_model(config, vocab_size=tok.vocab_size if tok else None,
                              num_classes=data_config.get("num_classes"))  # fmt: skip
    tx = optim.make_optimizer(config.optim, d_model=model.width,
                              num_train_steps=config.num_train_steps)  # fmt: skip
    init_fn, abstract, param_shardings = train.abstract_train_state(
        model, tx, task, loader.element_spec, mesh=mesh, rules=rules, ema=False
    )
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    repl = sharding.replicated(mesh)
    state = jax.jit(init_fn, out_shardings=shardings)(jax.random.key(0))
    batch_sh = {k: sharding.batch_sharding(mesh, rules, len(s.shape))
                for k, s in loader.element_spec.items()}  # fmt: skip
    step_fn = jax.jit(
        train.make_train_step(model, task, tx, mesh=mesh, rules=rules,
                              label_smoothing=config.loss.label_smoothing,
                              z_loss=config.loss.z_loss),
        in_shardings=(shardings, batch_sh, repl), out_shardings=(shardings, repl),
        donate_argnums=0,
    )  # fmt: skip
    eval_sh = {k: sharding.batch_sharding(mesh, rules, len(s.shape))
               for k, s in eval_loader.element_spec.items()}  # fmt: skip
    eval_fn = jax.jit(train.make_eval_step(model, task, mesh=mesh, rules=rules),
                      in_shardings=(param_shardings, eval_sh), out_shardings=repl)  # fmt: skip
    key = jax.jit(lambda: jax.random.key(1), out_shardings=repl)()

    batches = [sharding.shard_batch(next(loader), mesh, rules) for _ in range(4)]
    counter = CompileCounter()
    logging.getLogger("jax").addHandler(counter)
    with jax.log_compiles():
        start = time.perf_counter()
        state, stats = step_fn(state, batches[0], key)
        jax.block_until_ready(stats)
        first = time.perf_counter() - start
        times = []
        for i in range(steps):
            start = time.perf_counter()
            state, stats = step_fn(state, batches[i % len(batches)], key)
            jax.block_until_ready(stats)
            times.append(time.perf_counter() - start)
        eval_batches = 0
        for batch in eval_loader:  # one epoch; the last batch is zero-padded to full size
            jax.block_until_ready(eval_fn(state.params, sharding.shard_batch(batch, mesh, rules)))
            eval_batches += 1
    logging.getLogger("jax").removeHandler(counter)
    loader.close()
    eval_loader.close()

    step_s = statistics.median(times)
    example = {k: s.shape for k, s in loader.element_spec.items()}
    flops = config.batch_size * metrics.training_flops_per_example(model, abstract.params, example)
    peak = metrics.measure_peak_flops(mesh, train.COMPUTE_DTYPES[config.dtype])
    units = task.units_per_batch(loader.element_spec)
    n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
    return dict(
        family=family,
        params=n_params,
        batch=config.batch_size,
        first_s=first,
        step_ms=1e3 * step_s,
        rate=units / step_s,
        unit=task.UNIT,
        gflops=flops / 1e9,
        tflops_s=flops / step_s / 1e12,
        peak_tflops_s=peak / 1e12,
        mfu=flops / step_s / peak,
        train_compiles=counter.counts.get("train_step", 0),
        eval_compiles=counter.counts.get("eval_step", 0),
        eval_batches=eval_batches,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {args.devices} device(s), "
          f"{os.cpu_count()} CPU cores")  # fmt: skip
    rows = [bench(f, FAMILIES[f], steps=args.steps, devices=args.devices,
                  data_dir=args.data_dir) for f in args.families.split(",")]  # fmt: skip
    header = (f"{'family':10} {'params':>9} {'batch':>5} {'compile+1st s':>13} {'step ms':>8} "
              f"{'throughput':>20} {'GFLOP/step':>10} {'TFLOP/s':>8} {'peak TFLOP/s':>12} "
              f"{'MFU':>6} {'compiles (train, eval/batches)':>30}")  # fmt: skip
    print(header)
    for r in rows:
        print(f"{r['family']:10} {r['params']:>9,} {r['batch']:>5} {r['first_s']:>13.1f} "
              f"{r['step_ms']:>8.1f} {r['rate']:>12,.0f} {r['unit'] + '/s':>7} "
              f"{r['gflops']:>10.2f} {r['tflops_s']:>8.3f} {r['peak_tflops_s']:>12.3f} "
              f"{100 * r['mfu']:>5.1f}% {r['train_compiles']:>14}, "
              f"{r['eval_compiles']}/{r['eval_batches']}")  # fmt: skip
    bad = [r["family"] for r in rows if r["train_compiles"] != 1 or r["eval_compiles"] != 1]
    if bad:
        sys.exit(f"recompiled: {bad}")


if __name__ == "__main__":
    main()
