r"""The cross-entropy's label logit read two ways, side by side in one run: a gather
(`take_along_axis` from the bf16 logits, tfjax's form until 2026-11) and the masked sum over V of
`tfjax.tasks.losses.label_logits` (its form now).

    .venv/bin/python benchmarks/label_logit.py --topology=v5p:2x2x2 [--rows=4] \
        [--seq_len=2048] [--vocab=128256] [--out=FILE]
    python benchmarks/label_logit.py [--rows=8] [--seq_len=1024] [--rounds=20]  # on a GPU
    .venv/bin/python benchmarks/label_logit.py --tiny                          # smoke run

The program is the loss's part of a language-model train step: the sum of
`tfjax.tasks.losses.token_cross_entropy` over [rows, T, V] bfloat16 logits and its gradient
(the written-out backward pass, the same in both), with --rows rows per device, the batch
sharded over every device. The two forms differ only in how the forward pass reads each
position's label logit.

With --topology (a TPU slice) each form is compiled from this host by libtpu's compiler (no TPU
is used): the line says whether the compiler accepts it and its peak memory per chip, as
tfjax.runner.aot counts it. Without, both run on this machine's default backend (meant for a
GPU): their losses and gradients must be equal, and they are timed in rotated rounds; the last
line is the ratio of the medians (masked sum / gather; target <= 1.0: the new form does not
lose).

Results go to benchmarks/results/label_logit.json (or --out).
"""

import os
import sys
from unittest import mock

import harness
from harness import log

GiB = 2**30


def gathered(logits, labels):
    """The former form: a gather of each position's label logit, from the logits as given."""
    import jax.numpy as jnp

    return jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0].astype(jnp.float32)


def compile_forms(args, devices):
    """{form: jax.stages.Compiled or the compiler's error} of the loss and its gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tfjax.tasks import losses

    def loss_and_grad(logits, labels):
        def total(logits):
            return losses.token_cross_entropy(logits, labels)[0].sum()

        return jax.value_and_grad(total)(logits)

    mesh = Mesh(np.array(devices), ("batch",))
    rows = NamedSharding(mesh, PartitionSpec("batch"))
    shape = (args.rows * len(devices), args.seq_len)
    logits = jax.ShapeDtypeStruct((*shape, args.vocab), jnp.bfloat16, sharding=rows)
    labels = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows)
    forms = {}
    for form, read in (("gather", gathered), ("masked sum", losses.label_logits)):
        # A jit of its own per form: jit's trace cache does not know of the patched function.
        step = jax.jit(
            lambda *a: loss_and_grad(*a), out_shardings=(NamedSharding(mesh, PartitionSpec()), rows)
        )
        with mock.patch.object(losses, "label_logits", read):
            lowered = step.trace(logits, labels).lower()
        assert ("gather" in lowered.as_text()) == (form == "gather"), form
        try:
            forms[form] = lowered.compile()
        except Exception as e:  # noqa: BLE001 - the compiler's refusal is the result
            forms[form] = e
    return forms


def on_tpu(args, results):
    from tfjax.runner import aot

    devices = aot.topology_devices(args.topology)
    log(
        f"{args.topology}: {args.rows} x {args.seq_len} tokens a chip, V={args.vocab}, bf16 "
        f"logits {args.rows * args.seq_len * args.vocab * 2 / GiB:.2f} GiB a chip"
    )
    for form, compiled in compile_forms(args, devices).items():
        if isinstance(compiled, Exception):
            log(f"  {form:10s}: REFUSED: {aot.first_line(str(compiled))}")
            results[form] = {"compiled": False, "error": aot.first_line(str(compiled))}
            continue
        m = compiled.memory_analysis()
        peak = getattr(m, "peak_memory_in_bytes", 0) or 0
        temp = m.temp_size_in_bytes
        log(f"  {form:10s}: compiled, peak {peak / GiB:.2f} GiB, temporaries {temp / GiB:.2f} GiB")
        results[form] = {"compiled": True, "peak_bytes": peak, "temp_bytes": m.temp_size_in_bytes}
    if all(results[f].get("compiled") for f in ("gather", "masked sum")):
        ratio = results["masked sum"]["peak_bytes"] / results["gather"]["peak_bytes"]
        results["peak_ratio"] = ratio
        log(harness.ratio_line("peak masked sum / gather", ratio, at_most=1.0))


def on_this_machine(args, results):
    import jax
    import jax.numpy as jnp
    import numpy as np

    devices = jax.devices()
    log(
        f"{devices[0].device_kind} x {len(devices)}: {args.rows} x {args.seq_len} tokens a "
        f"device, V={args.vocab}, bf16 logits"
    )
    forms = compile_forms(args, devices)
    for form, compiled in forms.items():
        if isinstance(compiled, Exception):
            raise SystemExit(f"{form}: the compiler failed: {compiled}")
    shape = (args.rows * len(devices), args.seq_len)
    keys = jax.random.split(jax.random.key(0))
    logits = (3 * jax.random.normal(keys[0], (*shape, args.vocab))).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[1], shape, 0, args.vocab)
    (first, grad_a), (second, grad_b) = (forms[f](logits, labels) for f in forms)
    # The same float32 value is summed: the loss and the gradient must be equal.
    np.testing.assert_allclose(float(first), float(second), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad_a), np.asarray(grad_b))
    times = harness.medians(
        harness.time_rounds({f: lambda f=f: forms[f](logits, labels) for f in forms}, args.rounds)
    )
    for form, seconds in times.items():
        log(f"  {form:10s}: {seconds * 1e3:.3f} ms (median of {args.rounds})")
        results[form] = {"ms": seconds * 1e3}
    ratio = times["masked sum"] / times["gather"]
    results["time_ratio"] = ratio
    log(harness.ratio_line("time masked sum / gather", ratio, at_most=1.0))


def main(argv=None):
    p = harness.parser(__doc__, "label_logit")
    p.add_argument("--topology", default="", help="a TPU slice to compile for (v5p:2x2x2)")
    p.add_argument("--rows", type=int, default=4, help="rows per device")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.seq_len, args.vocab, args.rounds = 2, 16, 512, 3
    if args.topology:
        # Compile-only: the host computes nothing, and must not start a TPU backend of its own.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results = {**harness.header("label_logit", args, "jax", "jaxlib", "libtpu"), "args": vars(args)}
    (on_tpu if args.topology else on_this_machine)(args, results)
    harness.write_json(args.out, results)


if __name__ == "__main__":
    sys.exit(main())
