r"""How long the training loop blocks on a checkpoint save: asynchronous vs synchronous Orbax.

    python benchmarks/train_checkpoint.py [--width=768 --layers=12 --vocab=32768 --repeats=3]
                                          [--layouts=scanned,unrolled] [--tiny] [--out FILE]

A GPT-2-small-sized decoder's full training state (float32 parameters and both Adam moments,
~1.3 GB by default), as tfjax.runner.setup.set_up creates it from configs/lm.py with these sizes,
is saved with tfjax.runner.checkpoint as the loop saves it. "blocks" is the time
`save` takes to return (what the loop waits for); "durable" is the time until the checkpoint
is complete on disk. A first save of each kind runs untimed (it creates thread pools and, with
replica-parallel writing, compiles slicing programs).

Both parameter layouts are measured: `scan_layers=True` stacks each layer's weights into one
array per name (62 arrays in the default state), unrolled layers keep one array per layer and
name (590). Orbax's blocking part does Python bookkeeping per array, so the count matters as
much as the bytes. Writes benchmarks/results/train_checkpoint.json (or --out); --tiny saves a
toy model once per kind (smoke test).
"""

import os
import shutil
import statistics
import tempfile
import time

import harness
from harness import ROOT


def main():
    parser = harness.parser(__doc__, "train_checkpoint")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--layouts",
        default="scanned,unrolled",
        help="comma-separated: scanned (scan_layers=True), unrolled",
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    if args.tiny:
        args.width, args.layers, args.vocab, args.repeats = 64, 2, 256, 1
    layouts = args.layouts.split(",")
    if not layouts or not set(layouts) <= {"scanned", "unrolled"}:
        parser.error(f"--layouts={args.layouts!r}: allowed are scanned, unrolled (comma-separated)")

    import jax

    from tfjax import sharding

    mesh = sharding.make_mesh({"data": -1})
    print(f"jax {jax.__version__}, {jax.default_backend()}, {jax.device_count()} device(s)")
    root = args.dir or tempfile.mkdtemp(prefix="tfjax_ckpt_bench_")
    rows = []
    for layout in layouts:
        state = _train_state(args, layout == "scanned", mesh)
        leaves = jax.tree.leaves((state.params, state.opt_state))
        nbytes = sum(x.nbytes for x in leaves)
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        print(
            f"{layout}: {n_params / 1e6:.1f}M parameters, state {nbytes / 2**30:.2f} GiB "
            f"in {len(leaves)} arrays"
        )
        blocks = {}
        for mode in ("async", "sync"):
            blocks[mode] = _time_saves(args, state, os.path.join(root, layout, mode), mode)
        rows.append((layout, len(leaves), nbytes, blocks))
        del state
    shutil.rmtree(root, ignore_errors=True)

    print(f"{'layout':9} {'arrays':>6} {'save':6} {'loop blocks s':>14} {'durable after s':>16}")
    for layout, n_arrays, _, blocks in rows:
        for mode, (block, done) in blocks.items():
            print(f"{layout:9} {n_arrays:>6} {mode:6} {block:>14.3f} {done:>16.3f}")
    results = {}
    for layout, n_arrays, nbytes, blocks in rows:
        fraction = blocks["async"][0] / blocks["sync"][0]
        print(
            f"{layout}: async save blocks the loop for {100 * fraction:.1f}% of a sync save's "
            f"time (target < 5%)"
        )
        results[layout] = dict(
            arrays=n_arrays,
            bytes=nbytes,
            async_over_sync=fraction,
            **{f"{mode}_s": dict(blocks=b, durable=d) for mode, (b, d) in blocks.items()},
        )
    harness.write_json(
        args.out,
        dict(
            **harness.header("train_checkpoint", args, "jax", "orbax-checkpoint"),
            model=dict(width=args.width, layers=args.layers, vocab=args.vocab),
            repeats=args.repeats,
            results=results,
        ),
    )


def _config(args, scan_layers: bool, batch_size: int):
    """configs/lm.py:tiny made a GPT-2-small-like decoder of the given sizes (the variant's MLP,
    context and dropout), AdamW (0.9, 0.95), weight decay 0.1, clipping 1.0, float32."""
    from tfjax.runner import defaults, setup

    config = setup.load_config(os.path.join(ROOT, "configs/lm.py") + ":tiny")
    config.model.update(
        variant="gpt2-small",
        vocab_size=args.vocab,
        width=args.width,
        num_layers=args.layers,
        num_heads=args.width // 64,
        mlp_dim=None,
        max_len=None,
        dropout_rate=None,
        scan_layers=scan_layers,
    )
    config.update(
        batch_size=batch_size, eval_batch_size=batch_size, num_train_steps=1, dtype="float32"
    )
    config.optim = defaults.optim(
        learning_rate=1e-3,
        schedule="constant",
        warmup_steps=0,
        end_learning_rate_fraction=0.0,
        b2=0.95,
        weight_decay=0.1,
    )
    return config


def _train_state(args, scan_layers: bool, mesh):
    """A decoder's initialised training state (parameters and AdamW moments) on `mesh`."""
    import math

    import jax
    import jax.numpy as jnp

    from tfjax.runner import setup

    # Rows of 128 tokens, as many as shard evenly: the batch sets the (unused) steps' shapes,
    # not the state's.
    config = _config(args, scan_layers, batch_size=math.lcm(8, mesh.size))
    batch = {
        "tokens": jax.ShapeDtypeStruct((config.batch_size, 128), jnp.int32),
        "weights": jax.ShapeDtypeStruct((config.batch_size, 128), jnp.float32),
    }
    inputs = setup.Inputs(train=batch, eval=batch, vocab_size=args.vocab)
    state = setup.set_up(config, mesh, inputs=inputs).init(jax.random.key(0))
    # Adam's moments start at zero; fill them so that nothing compresses unusually well.
    state = state.replace(
        opt_state=jax.tree.map(lambda x: x + 0.001 if x.ndim else x, state.opt_state)
    )
    return jax.block_until_ready(state)


def _time_saves(args, state, directory: str, mode: str) -> tuple[float, float]:
    """Median seconds (save returned, checkpoint durable) over `args.repeats` saves."""
    import ml_collections

    from tfjax.runner import checkpoint

    shutil.rmtree(directory, ignore_errors=True)
    config = ml_collections.ConfigDict(
        dict(
            every=1,
            keep=2,
            best_metric="",
            best_mode="max",
            async_save=mode == "async",
            replica_parallel=True,
        )
    )
    manager = checkpoint.make_manager(directory, config)
    blocks, durable = [], []
    for step in range(args.repeats + 1):
        start = time.perf_counter()
        checkpoint.save(
            manager,
            step,
            params=state.params,
            state=dict(step=state.step, opt_state=state.opt_state),
            data_state={"position": step},
        )
        returned = time.perf_counter()
        manager.wait_until_finished()
        done = time.perf_counter()
        if step:  # the first save of each kind warms up
            blocks.append(returned - start)
            durable.append(done - start)
    manager.close()
    return statistics.median(blocks), statistics.median(durable)


if __name__ == "__main__":
    main()
