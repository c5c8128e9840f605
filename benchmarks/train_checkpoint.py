r"""How long the training loop blocks on a checkpoint save: asynchronous vs synchronous Orbax.

    python benchmarks/train_checkpoint.py [--width=768 --layers=12 --vocab=32768 --repeats=3]

A GPT-2-small-sized decoder's full training state (float32 parameters and both Adam moments,
~1.3 GB by default) is saved with tfjax.checkpoint as the loop saves it. "blocks" is the time
`save` takes to return (what the loop waits for); "durable" is the time until the checkpoint
is complete on disk. A first save of each kind runs untimed (it creates thread pools and, with
replica-parallel writing, compiles slicing programs).
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import ml_collections

    from tfjax import checkpoint, optim, sharding, tasks, train
    from tfjax.models import decoder

    mesh = sharding.make_mesh({"data": -1})
    rules = sharding.DEFAULT_RULES
    model = decoder.Model("gpt2-small", vocab_size=args.vocab, width=args.width,
                          num_layers=args.layers, num_heads=args.width // 64)  # fmt: skip
    oc = ml_collections.ConfigDict(dict(
        name="adamw", learning_rate=1e-3, schedule="constant", warmup_steps=0,
        end_learning_rate_fraction=0.0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
        grad_clip_norm=1.0, ema_decay=0.0))  # fmt: skip
    tx = optim.make_optimizer(oc, d_model=args.width, num_train_steps=1)
    spec = {"tokens": jax.ShapeDtypeStruct((8, 128), jnp.int32)}
    init_fn, abstract, _ = train.abstract_train_state(
        model, tx, tasks.get("lm"), spec, mesh=mesh, rules=rules, ema=False
    )
    state = jax.jit(init_fn, out_shardings=jax.tree.map(lambda a: a.sharding, abstract))(
        jax.random.key(0)
    )
    # Adam's moments start at zero; fill them so that nothing compresses unusually well.
    state = state.replace(opt_state=jax.tree.map(lambda x: x + 0.001 if x.ndim else x,
                                                 state.opt_state))  # fmt: skip
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    print(f"jax {jax.__version__}, {jax.default_backend()}, {jax.device_count()} device(s); "
          f"{n_params / 1e6:.1f}M parameters, state {nbytes / 2**30:.2f} GiB")  # fmt: skip

    root = args.dir or tempfile.mkdtemp(prefix="tfjax_ckpt_bench_")
    results = {}
    for mode in ("async", "sync"):
        directory = os.path.join(root, mode)
        shutil.rmtree(directory, ignore_errors=True)
        config = ml_collections.ConfigDict(dict(every=1, keep=2, best_metric="", best_mode="max",
                                                async_save=mode == "async",
                                                replica_parallel=True))  # fmt: skip
        manager = checkpoint.make_manager(directory, config)
        blocks, durable = [], []
        for step in range(args.repeats + 1):
            start = time.perf_counter()
            checkpoint.save(manager, step, params=state.params,
                            state=dict(step=state.step, opt_state=state.opt_state),
                            data_state={"position": step})  # fmt: skip
            returned = time.perf_counter()
            manager.wait_until_finished()
            done = time.perf_counter()
            if step:  # the first save of each kind warms up
                blocks.append(returned - start)
                durable.append(done - start)
        manager.close()
        results[mode] = (statistics.median(blocks), statistics.median(durable))
    shutil.rmtree(root, ignore_errors=True)

    print(f"{'save':6} {'loop blocks s':>14} {'durable after s':>16}")
    for mode, (block, done) in results.items():
        print(f"{mode:6} {block:>14.3f} {done:>16.3f}")
    ratio = results["sync"][0] / results["async"][0]
    print(f"async save blocks the loop {ratio:.1f}x less than a sync save "
          f"({100 / ratio:.1f}% of its time; target < 5%)")  # fmt: skip


if __name__ == "__main__":
    main()
