"""What tests/nnx's family tests check alike: that an NNX model has its Linen twin's parameter
tree (paths, shapes, dtypes, logical names), and that from the same parameters both compute the
same outputs and gradients."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict

from tfjax.nnx import functional, models


def flat(tree):
    return flatten_dict(nn.meta.unbox(tree))


def layout(tree):
    return {path: (x.shape, x.dtype) for path, x in flat(tree).items()}


def close(got, want):
    """Equal to 1e-6 of the array's scale (float32; see test_nnx_decoder._close)."""
    scale = max(1.0, float(np.abs(np.asarray(want)).max()))
    np.testing.assert_allclose(got, want, atol=1e-6 * scale, rtol=1e-6)


def assert_same_tree(params, model):
    """The NNX `model`'s parameters have the (boxed) Linen `params`' paths, shapes, dtypes and
    logical axis names; and as Functional.init gives them (functional.boxed_params), the same
    tree of the same nn.LogicallyPartitioned boxes (their names are the tree's structure)."""
    state = nnx.state(model, nnx.Param)
    assert layout(nnx.to_pure_dict(state)) == layout(params)
    names = flatten_dict(nnx.to_pure_dict(nnx.get_partition_spec(state)))
    assert names == flatten_dict(nn.get_partition_spec(params))
    boxed = functional.boxed_params(model)
    assert jax.tree.structure(boxed) == jax.tree.structure(params)
    assert layout(boxed) == layout(params)


def loss(out, aux):
    """A scalar that reaches every parameter: the weighted outputs, and the squares of every
    auxiliary output (the trunk's states, which a zero-initialised head would not pass on)."""
    w = jax.random.normal(jax.random.key(7), out.shape)
    return jnp.sum(out * w) + 1e-2 * sum(jnp.sum(x**2) for x in jax.tree.leaves(aux))


def assert_same_function(lm, model, params, *args, method=None, **kwargs):
    """Linen `lm` with `params` (unboxed) and the NNX `model` given them compute the same
    outputs, loss and gradients on `args` and `kwargs` (the first output and the rest, aux);
    every parameter's gradient is nonzero. Returns the NNX outputs."""
    models.load_params(model, params)

    def linen_loss(p):
        out, aux = lm.apply({"params": p}, *args, method=method, **kwargs)
        return loss(out, aux), (out, aux)

    def nnx_loss(m):
        out, aux = getattr(m, method or "__call__")(*args, **kwargs)
        return loss(out, aux), (out, aux)

    (want_loss, want), want_grads = jax.value_and_grad(linen_loss, has_aux=True)(params)
    (got_loss, got), grads = nnx.value_and_grad(nnx_loss, has_aux=True)(model)
    close(got_loss, want_loss)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(close, got, want)
    grads, want_grads = flat(nnx.to_pure_dict(grads)), flat(want_grads)
    assert grads.keys() == want_grads.keys()
    for path in grads:
        close(grads[path], want_grads[path])
    unreached = [path for path, g in grads.items() if not np.abs(g).max() > 0]
    assert not unreached, f"no gradient reaches {unreached}"
    return got


def assert_same_packed_logits_and_gradients(lm, model, params, tokens, vocab: int):
    """`tokens` [2, 9] as packed rows (segments of 5 and 4, then one of 9) through the Linen
    model `lm` (its `params`) and the NNX `model` (loaded with them): the same logits, loss and
    gradients, compiled (op by op, experts' dispatch takes longer than compiling). Returns
    (Linen's logits, the NNX gradients and Linen's, each flattened by path)."""
    models.load_params(model, params)
    segment_ids = jnp.asarray([[1] * 5 + [2] * 4, [1] * 9])
    positions = jnp.asarray([list(range(5)) + list(range(4)), list(range(9))])
    call = dict(segment_ids=segment_ids, positions=positions)
    w = jax.random.normal(jax.random.key(3), (2, 9, vocab))

    def linen_loss(p):
        logits, _ = lm.apply({"params": p}, tokens, **call)
        return jnp.sum(logits * w), logits

    def nnx_loss(m):
        logits, _ = m(tokens, **call)
        return jnp.sum(logits * w), logits

    (want_loss, want), want_grads = jax.jit(jax.value_and_grad(linen_loss, has_aux=True))(params)
    (got_loss, got), grads = nnx.jit(nnx.value_and_grad(nnx_loss, has_aux=True))(model)
    close(got, want)
    close(got_loss, want_loss)
    grads, want_grads = flatten_dict(nnx.to_pure_dict(grads)), flatten_dict(want_grads)
    assert grads.keys() == want_grads.keys()
    for path in grads:
        close(grads[path], want_grads[path])
    return want, grads, want_grads
