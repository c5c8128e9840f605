"""tfjax.nnx.functional.Functional: an NNX family model behind Linen's init and apply. Its init
makes the NNX model's parameters as Linen's tree (the same boxes and logical names, values of
its own); its apply, computed by the NNX
model inside the caller's jit, gives the Linen model's outputs (the call, a method, dropout
keys, the explicit cache) and refuses what NNX has no counterpart for."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.models import decoder as linen
from tfjax.nnx import functional, models

VOCAB = 64
FIELDS = dict(vocab_size=VOCAB, num_layers=2, scan_layers=True)


@pytest.fixture(scope="module")
def built():
    """(Linen model, its Functional, its boxed params, tokens [2, 8])."""
    lm = linen.Model("modern-tiny", **FIELDS)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, VOCAB, (2, 8)))
    fn = functional.Functional(lm)
    return lm, fn, fn.init(jax.random.key(0), tokens)["params"], tokens


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _layout(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype), nn.unbox(tree))


def test_init_has_the_linen_tree_and_values_of_its_own(built):
    """init is the NNX model's: Linen's tree, boxes, logical names, shapes and dtypes, its own
    values (other RNG use), the same ones for the same key."""
    lm, fn, boxed, tokens = built
    want = lm.init(jax.random.key(0), tokens)["params"]
    assert jax.tree.structure(boxed) == jax.tree.structure(want)  # boxed alike, same names
    assert nn.get_partition_spec(boxed) == nn.get_partition_spec(want)
    assert _layout(boxed) == _layout(want)
    kernel = ("decoder", "layers", "mlp", "wi_0", "kernel")
    got, linen_kernel = (nn.unbox(t) for t in (boxed, want))
    for key in kernel:
        got, linen_kernel = got[key], linen_kernel[key]
    assert not np.array_equal(got, linen_kernel)
    again = fn.init({"params": jax.random.key(0)}, tokens)["params"]
    jax.tree.map(np.testing.assert_array_equal, nn.unbox(again), nn.unbox(boxed))


@pytest.mark.parametrize(
    "family, fields, inputs",
    [
        ("decoder", dict(variant="moe-tiny", vocab_size=VOCAB, first_dense_layers=1), (2, 8)),
        ("encoder", dict(variant="tiny", vocab_size=VOCAB, head="classifier"), (2, 8)),
        ("transformer", dict(variant="tiny", vocab_size=VOCAB, position="relative"), None),
        ("vit", dict(variant="tiny/4", num_classes=3, pool="map", num_registers=2), None),
    ],
)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_init_of_each_family_is_linens_tree_abstractly(family, fields, inputs, scan_layers):
    """Functional.init of each family, made of its spec (tfjax.specs) as of its Linen model:
    Linen init's tree, boxes and logical names, shapes and dtypes (abstractly: nothing drawn)."""
    import importlib

    fields = dict(fields, scan_layers=scan_layers)
    variant = fields.pop("variant")
    lm = importlib.import_module(f"tfjax.models.{family}").Model(variant, **fields)
    spec = importlib.import_module(f"tfjax.specs.{family}").Model(variant, **fields)
    if family == "vit":
        args = (jnp.zeros((1, 8, 12, 1)),)
    elif family == "transformer":
        args = (jnp.ones((2, 7), jnp.int32), jnp.ones((2, 5), jnp.int32))
    else:
        args = (jnp.ones(inputs, jnp.int32),)
    key = jax.random.key(0)
    want = jax.eval_shape(lambda k: lm.init(k, *args)["params"], key)
    for fn in (functional.Functional(spec, *args), functional.Functional(lm, *args)):
        got = jax.eval_shape(lambda k, fn=fn: fn.init(k, *args)["params"], key)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        assert _layout(got) == _layout(want)


def test_apply_computes_the_linen_outputs_inside_a_jit(built):
    lm, fn, boxed, tokens = built
    params = nn.unbox(boxed)
    variables = {"params": params}

    @jax.jit
    def both(params):
        v = {"params": params}
        return fn.apply(v, tokens), lm.apply(v, tokens)

    (got, aux), (want, want_aux) = both(params)
    _close(got, want)
    _close(aux["pre_logits"], want_aux["pre_logits"])
    hidden, _ = fn.apply(variables, tokens, apply_head=False)
    _close(fn.apply(variables, hidden, method="logits"), want)
    _close(fn.apply(variables, hidden, method=linen.Decoder.logits), want)
    # mutable: the auxiliary losses only; a dense model sows none
    (out, _), sown = fn.apply(variables, tokens, mutable=["aux_losses"])
    assert sown == {}
    _close(out, want)
    # the explicit cache, its Linen flag included; fields read off the Linen model
    assert fn.vocab_size == VOCAB and fn.scan_layers
    cache, want_cache = fn.init_cache(2, 8), lm.init_cache(2, 8)
    for step in (tokens[:, :5], tokens[:, 5:6]):
        (got, _), cache = fn.apply(variables, step, decode=True, cache=cache)
        (want, _), want_cache = lm.apply(variables, step, decode=True, cache=want_cache)
        _close(got, want)
    jax.tree.map(_close, cache, want_cache)


def test_dropout_keys_are_translated():
    """rngs={"dropout": key} reaches the NNX model's dropout: the same key, the same draws; a
    call without train has none."""
    lm = linen.Model("tiny", vocab_size=VOCAB, dropout_rate=0.5)
    tokens = jnp.ones((2, 8), jnp.int32)
    fn = functional.Functional(lm)
    variables = {"params": nn.unbox(fn.init(jax.random.key(0), tokens)["params"])}

    def train(seed):
        return fn.apply(variables, tokens, train=True, rngs={"dropout": jax.random.key(seed)})[0]

    plain = fn.apply(variables, tokens)[0]
    _close(fn.apply(variables, tokens, rngs={"dropout": jax.random.key(1)})[0], plain)
    np.testing.assert_array_equal(train(1), train(1))
    assert not np.allclose(train(1), train(2)) and not np.allclose(train(1), plain)


def test_equal_specs_make_equal_functionals(built):
    lm, fn, _, _ = built
    same = functional.Functional(linen.Model("modern-tiny", **FIELDS))
    assert same == fn and hash(same) == hash(fn)
    assert functional.Functional(linen.Model("modern-tiny", **{**FIELDS, "num_layers": 3})) != fn


def test_split_gives_the_nnx_models_function_and_params(built):
    lm, fn, boxed, tokens = built
    model = models.from_linen(lm, rngs=nnx.Rngs(1))
    got_fn, params = functional.split(model)
    assert got_fn == fn
    remade = jax.eval_shape(lambda k: got_fn.init(k, tokens)["params"], jax.random.key(0))
    assert jax.tree.structure(remade) == jax.tree.structure(boxed)  # its spec's model, remade
    _close(got_fn.apply({"params": params}, tokens)[0], model(tokens)[0])
    with pytest.raises(TypeError, match="Linear is not a tfjax.nnx.models family model"):
        functional.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))


def test_what_nnx_cannot_do_is_refused(built):
    lm, fn, boxed, tokens = built
    params = nn.unbox(boxed)
    with pytest.raises(ValueError, match=r"mutable=\['cache'\]: an NNX model's apply can"):
        fn.apply({"params": params}, tokens, decode=True, mutable=["cache"])
    with pytest.raises(ValueError, match=r"mutable=\['intermediates'\]"):
        fn.apply({"params": params}, tokens, mutable=["intermediates"])
    with pytest.raises(ValueError, match=r"mutable=True"):
        fn.apply({"params": params}, tokens, mutable=True)
    with pytest.raises(ValueError, match="decode=True without cache="):
        fn.apply({"params": params}, tokens, decode=True)
    with pytest.raises(ValueError, match=r"variables hold \['cache'\]"):
        fn.apply({"params": params, "cache": {}}, tokens)
    with pytest.raises(ValueError, match=r"train=True\) needs rngs=\{'dropout': key\}"):
        fn.apply({"params": params}, tokens, train=True)
    with pytest.raises(AttributeError, match="Functional has no 'clone'"):
        fn.clone(scan_layers=False)
    with pytest.raises(NotImplementedError, match="no NNX model for Dense yet; it has: Decoder"):
        functional.Functional(nn.Dense(3))


def test_a_vit_is_sized_by_example_images():
    """A ViT's NNX model takes its image size from example inputs (as Linen's init does);
    models of other sizes are other Functionals."""
    from tfjax.models import vit

    spec = vit.Model("tiny/4", num_classes=3, posemb="learned")
    images = jax.ShapeDtypeStruct((1, 8, 12, 1), jnp.float32)
    fn = functional.Functional(spec, images)
    params = spec.init(jax.random.key(0), jnp.zeros(images.shape))["params"]
    x = jax.random.normal(jax.random.key(1), (2, 8, 12, 1))
    _close(fn.apply({"params": params}, x)[0], spec.apply({"params": params}, x)[0])
    assert fn != functional.Functional(spec)  # 224 x 224 x 3 images
    assert fn == functional.Functional(spec, jax.ShapeDtypeStruct((5, 8, 12, 1), jnp.float32))
    remade, _ = functional.split(models.from_spec(spec, images, rngs=nnx.Rngs(0)))
    assert remade == fn  # the model of the same image size
    layout = jax.eval_shape(lambda k: remade.init(k)["params"], jax.random.key(0))
    assert jax.tree.map(lambda x: x.shape, nn.unbox(layout)) == jax.tree.map(
        lambda x: x.shape, nn.unbox(params)
    )
