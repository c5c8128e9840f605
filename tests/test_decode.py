"""Greedy, sampling and beam search: equivalences, the KV cache, EOS handling, padding masks,
bad input."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import decode
from tfjax.decode import search
from tfjax.models import decoder, transformer

V, EOS = 40, 3


@pytest.fixture(scope="module")
def gpt():
    m = decoder.Model(variant="modern-tiny", vocab_size=V)
    return m, m.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]


@pytest.fixture(scope="module")
def encdec():
    m = transformer.Model(variant="tiny", vocab_size=V)
    src = jnp.ones((1, 5), jnp.int32)
    return m, m.init(jax.random.key(1), src, src)["params"]


@pytest.fixture(scope="module")
def t5():
    """An encoder-decoder with T5's relative position bias (its decode-time keys: the cache's)."""
    sizes = dict(width=32, num_layers=2, num_heads=4, head_dim=8, mlp_dim=40)
    m = transformer.Model("flan-t5-small", vocab_size=V, scan_layers=True, **sizes)
    src = jnp.ones((1, 5), jnp.int32)
    return m, m.init(jax.random.key(2), src, src)["params"]


# Id 0 is an ordinary token (as "!" in GPT-2, Llama 3 and Qwen), EOS too inside a prompt; the
# padding (V - 1 here) is known from the mask alone.
PROMPTS = jnp.array([[5, 0, 7, 8], [0, EOS, V - 1, V - 1], [11, 0, 13, V - 1]])
MASK = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], bool)
LENGTHS = (4, 2, 3)
SOURCES = jnp.array([[5, 6, 7, 8, 9], [9, 10, 0, 0, 0]])


def both(gpt, encdec):
    """(model, params, inputs, generate's mask keyword) of each kind of model."""
    return [(gpt[0], gpt[1], PROMPTS, dict(mask=MASK)), (encdec[0], encdec[1], SOURCES, {})]


@pytest.mark.parametrize("kind", [0, 1], ids=["decoder", "encoder-decoder"])
@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_cache_equals_recomputing_the_prefix(gpt, encdec, kind, method):
    model, params, inputs, kw = both(gpt, encdec)[kind]
    if method == "beam" and kind == 0:
        inputs, kw = PROMPTS[:, :2], {}  # beam search takes equal-length prompts
    kw = dict(kw, max_new_tokens=7, eos_id=EOS, method=method)
    t1, s1 = decode.generate(model, params, inputs, use_cache=True, **kw)
    t2, s2 = decode.generate(model, params, inputs, use_cache=False, **kw)
    np.testing.assert_array_equal(t1, t2)
    np.testing.assert_allclose(s1, s2, atol=1e-4)


@pytest.mark.parametrize("kind", ["decoder", "encoder-decoder", "t5"])
@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_explicit_cache_equals_the_collection(gpt, encdec, t5, kind, method):
    """generate carries tfjax models' explicit KV cache; Flax's "cache" collection gives the
    same tokens and scores to the bit."""
    model, params = {"decoder": gpt, "encoder-decoder": encdec, "t5": t5}[kind]
    inputs, kw = (PROMPTS, dict(mask=MASK)) if kind == "decoder" else (SOURCES, {})
    if method == "beam" and kind == "decoder":
        inputs, kw = PROMPTS[:, :2], {}  # beam search takes equal-length prompts
    kw = dict(kw, max_new_tokens=7, eos_id=EOS, method=method, beam_size=3)
    explicit, explicit_scores = decode.generate(model, params, inputs, **kw)
    collection, scores = decode.generate(model, params, inputs, use_cache="collection", **kw)
    np.testing.assert_array_equal(explicit, collection)
    np.testing.assert_array_equal(explicit_scores, scores)
    with pytest.raises(ValueError, match="use_cache='explicit' is unknown"):
        decode.generate(model, params, inputs, use_cache="explicit", **kw)


def test_greedy_continues_each_prompt_by_its_own_argmax(gpt):
    """Row by row, the continuation is the argmax of the full forward pass at every step (the
    prompts hold id 0 and EOS as ordinary tokens)."""
    model, params = gpt
    tokens, _ = decode.generate(model, params, PROMPTS, mask=MASK, max_new_tokens=5, eos_id=EOS)
    for b, (row, length) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
        seq = list(np.asarray(row[:length]))
        for _ in range(5):
            logits, _ = model.apply({"params": params}, jnp.array([seq]))
            nxt = int(jnp.argmax(logits[0, -1]))
            seq.append(nxt)
            if nxt == EOS:
                break
        assert tokens[b, : len(seq) - length].tolist() == seq[length:]


@pytest.mark.parametrize("kind", [0, 1], ids=["decoder", "encoder-decoder"])
def test_beam_of_one_and_top_k_of_one_equal_greedy(gpt, encdec, kind):
    model, params, inputs, _ = both(gpt, encdec)[kind]
    inputs = inputs[:, :2] if kind == 0 else inputs
    kw = dict(max_new_tokens=6, eos_id=EOS)
    greedy, g_scores = decode.generate(model, params, inputs, **kw)
    beam, _ = decode.generate(model, params, inputs, method="beam", beam_size=1, alpha=0.0, **kw)
    np.testing.assert_array_equal(greedy, beam)
    top1, t_scores = decode.generate(
        model, params, inputs, method="sample", top_k=1, rng=jax.random.key(3), **kw
    )
    np.testing.assert_array_equal(greedy, top1)
    np.testing.assert_allclose(g_scores, t_scores, atol=1e-5)


SAMPLE_KW = dict(
    mask=MASK, max_new_tokens=8, eos_id=EOS, method="sample", temperature=2.0, top_p=0.95
)


def test_sampling_is_reproducible(gpt):
    model, params = gpt
    kw = SAMPLE_KW
    a, _ = decode.generate(model, params, PROMPTS, rng=jax.random.key(1), **kw)
    b, _ = decode.generate(model, params, PROMPTS, rng=jax.random.key(1), **kw)
    c, _ = decode.generate(model, params, PROMPTS, rng=jax.random.key(2), **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept = search._filter_logits(logits, 1.0, 0, 0.7) > -1e29
    assert kept.tolist() == [[True, True, False, False]]
    kept = search._filter_logits(logits, 1.0, 0, 0.85) > -1e29
    assert kept.tolist() == [[True, True, True, False]]
    kept = search._filter_logits(logits, 1.0, 2, 1.0) > -1e29
    assert kept.tolist() == [[True, True, False, False]]


class Bigram(nn.Module):
    """next-token log-probs = table[current token]: a model whose sequence scores are known."""

    table: tuple  # [V, V] log-probabilities, as nested tuples (jit needs a hashable model)
    vocab_size: int = 6
    max_len: int = 16

    @nn.compact
    def __call__(self, tokens, *, decode=False, train=False):
        if decode:  # a cache collection like the real models' (the bigram needs no state)
            self.variable("cache", "steps", lambda: jnp.zeros((), jnp.int32))
        return jnp.asarray(self.table)[tokens], {}


def bigram_table():
    """From token 1: A=4 (p 0.6) or B=5 (p 0.4). After A, four tokens at 0.25 each, EOS among
    them; after B, EOS with 0.97. Greedy takes A then EOS (0.15); beam finds B, EOS (0.388)."""
    p = np.full((6, 6), 1e-9)
    p[1, 4], p[1, 5] = 0.6, 0.4
    p[4, [1, 2, EOS, 4]] = 0.25
    p[5, EOS], p[5, 2] = 0.97, 0.03
    p[EOS, EOS] = p[2, EOS] = 1.0  # anything after the end
    return tuple(map(tuple, np.log(p / p.sum(1, keepdims=True)).astype(np.float32).tolist()))


def test_beam_search_finds_the_more_probable_sequence():
    model = Bigram(table=bigram_table())
    prompt = jnp.array([[1]])
    greedy, g_score = decode.generate(model, {}, prompt, max_new_tokens=4, eos_id=EOS)
    beam, b_score = decode.generate(
        model, {}, prompt, max_new_tokens=4, eos_id=EOS, method="beam", beam_size=2, alpha=0.0
    )
    assert greedy[0, 0] == 4 and beam[0].tolist()[:2] == [5, EOS]
    assert float(b_score[0]) == pytest.approx(np.log(0.4 * 0.97), abs=1e-4)
    assert float(b_score[0]) > float(g_score[0])


def test_finished_sequences_are_padded_and_stop_scoring():
    model = Bigram(table=bigram_table())
    tokens, score = decode.generate(model, {}, jnp.array([[5]]), max_new_tokens=6, eos_id=EOS)
    assert tokens[0].tolist() == [EOS, 0, 0, 0, 0, 0]
    assert float(score[0]) == pytest.approx(np.log(0.97), abs=1e-4)
    beam, b_score = decode.generate(
        model,
        {},
        jnp.array([[5]]),
        max_new_tokens=6,
        eos_id=EOS,
        method="beam",
        beam_size=3,
        alpha=0.6,
    )
    assert beam[0].tolist() == [EOS, 0, 0, 0, 0, 0]
    # Length 1 -> penalty ((5 + 1) / 6)^0.6 = 1.
    assert float(b_score[0]) == pytest.approx(np.log(0.97), abs=1e-4)


def test_bad_options_name_themselves(gpt, encdec):
    model, params = gpt
    kw = dict(max_new_tokens=4, eos_id=EOS)
    # A learned position table ends at max_len (RoPE models, like `gpt`, go past it, as
    # dynamic RoPE scaling needs; tests/interop/test_interop.py).
    learned = decoder.Model(variant="tiny", vocab_size=V)
    learned_params = learned.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
    with pytest.raises(ValueError, match="exceeds the model's max_len=256"):
        decode.generate(learned, learned_params, PROMPTS, max_new_tokens=300, eos_id=EOS)
    for mask, message in [
        (MASK[:, :3], r"mask has shape \(3, 3\); the inputs' is \(3, 4\)"),
        (MASK.at[1].set(False), "mask row 1 is empty"),
        (MASK.at[2].set([True, False, True, True]), "mask row 2 is true on columns 0..0, 2..3 "),
        (MASK.at[0].set([False, True, True, False]), r"mask row 0 is true on columns 1..2 of 0..3"),
        (MASK.astype(float), "mask must be bool or integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            decode.generate(model, params, PROMPTS, mask=mask, **kw)
    with pytest.raises(ValueError, match="mask has shape"):  # unchecked: the shape still is
        decode.generate(model, params, PROMPTS, mask=MASK[:2], check=False, **kw)
    with pytest.raises(ValueError, match="mask applies to decoder prompts"):
        decode.generate(*encdec, SOURCES, mask=SOURCES != 0, **kw)
    for eos, message in [
        ((), "eos_id is empty"),
        ((EOS, V), rf"eos_id=\({EOS}, {V}\) holds {V}, not an id in \[0, {V}\)"),
        (-1, "eos_id=-1 holds -1"),
        (1.5, "eos_id=1.5 must be an id or a sequence of ids"),
    ]:
        with pytest.raises(ValueError, match=message):
            decode.generate(model, params, PROMPTS, max_new_tokens=4, eos_id=eos)
    with pytest.raises(ValueError, match=f"pad_id=-1 is not an id in \\[0, {V}\\)"):
        decode.generate(model, params, PROMPTS, pad_id=-1, **kw)
    with pytest.raises(ValueError, match="token id 99, outside the vocabulary"):
        decode.generate(model, params, jnp.array([[5, 99]]), **kw)
    with pytest.raises(ValueError, match="beam_size must be at least 1, got 0"):
        decode.generate(model, params, PROMPTS, method="beam", beam_size=0, **kw)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            decode.generate(
                model, params, PROMPTS, method="sample", top_p=top_p, rng=jax.random.key(0), **kw
            )
    with pytest.raises(ValueError, match="method='nucleus' is unknown"):
        decode.generate(model, params, PROMPTS, method="nucleus", **kw)
    with pytest.raises(ValueError, match="needs an rng"):
        decode.generate(model, params, PROMPTS, method="sample", **kw)
    with pytest.raises(ValueError, match="equal length"):
        decode.generate(model, params, PROMPTS, mask=MASK, method="beam", **kw)
    with pytest.raises(ValueError, match=r"beam_rules='t5x' is unknown; allowed: \('gnmt', 'hf'\)"):
        decode.generate(model, params, PROMPTS[:1], method="beam", beam_rules="t5x", **kw)
    with pytest.raises(ValueError, match="early_stopping='always' is unknown; allowed: "):
        decode.generate(
            model,
            params,
            PROMPTS[:1],
            method="beam",
            beam_rules="hf",
            early_stopping="always",
            **kw,
        )
    with pytest.raises(ValueError, match="early_stopping=True applies to beam_rules='hf' only"):
        decode.generate(model, params, PROMPTS[:1], method="beam", early_stopping=True, **kw)


def left_padded(prompts, mask):
    """The same prompts and mask [B, P], each row's prompt moved to the right edge."""
    shift = mask.shape[1] - mask.sum(1)
    columns = (jnp.arange(mask.shape[1])[None] - shift[:, None]) % mask.shape[1]
    return jnp.take_along_axis(prompts, columns, 1), jnp.take_along_axis(mask, columns, 1)


def test_padded_prompts_decode_as_each_prompt_alone(gpt):
    """Right- and left-padded prompts (holding id 0) continue as each prompt alone, unpadded."""
    model, params = gpt
    left, left_mask = left_padded(PROMPTS, MASK)
    assert left_mask[1].tolist() == [False, False, True, True] and left[1, 2] == 0
    kw = dict(max_new_tokens=5, eos_id=EOS)  # test_greedy_continues_...'s program
    want, want_scores = decode.generate(model, params, PROMPTS, mask=MASK, **kw)
    got, got_scores = decode.generate(model, params, left, mask=left_mask, **kw)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_scores, want_scores)
    for b, length in enumerate(LENGTHS):
        alone, score = decode.generate(model, params, PROMPTS[b : b + 1, :length], **kw)
        np.testing.assert_array_equal(alone[0], want[b])
        np.testing.assert_allclose(score[0], want_scores[b], atol=1e-5)
    # Sampling (a row's draws depend on the batch, so against the right-padded batch only).
    want, want_scores = decode.generate(model, params, PROMPTS, rng=jax.random.key(1), **SAMPLE_KW)
    kw = dict(SAMPLE_KW, mask=left_mask)
    got, got_scores = decode.generate(model, params, left, rng=jax.random.key(1), **kw)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_scores, want_scores)


E1, E2 = 2, 3  # two EOS ids, as Llama 3's <|eot_id|> and <|end_of_text|>


def two_eos_table():
    """From 1: 0 (p 0.7; id 0 an ordinary token) then 4, then E1 (0.9); or 5 (0.3). From 5: E2
    (0.9) or E1 (0.1). After either EOS: the other one. So prompt 1 ends at E1 by [0, 4, E1]
    (0.63, the best of all); prompt 5 ends at E2 (0.9)."""
    p = np.full((6, 6), 1e-9)
    p[1, 0], p[1, 5] = 0.7, 0.3
    p[0, 4] = 1.0
    p[4, E1], p[4, 1] = 0.9, 0.1
    p[5, E2], p[5, E1] = 0.9, 0.1
    p[E1, E2] = p[E2, E1] = 1.0
    return tuple(map(tuple, np.log(p / p.sum(1, keepdims=True)).astype(np.float32).tolist()))


@pytest.mark.parametrize("method", ["greedy", "sample", ("beam", "gnmt"), ("beam", "hf")], ids=str)
def test_generation_stops_at_the_first_of_several_eos_ids(method):
    """Each row ends at whichever EOS id comes first, exactly as when that id is the only one;
    a generated 0 is a token like any other (kept, and first_eos cuts at the EOS only)."""
    model = Bigram(table=two_eos_table())
    prompts = jnp.array([[1], [5]])
    method, rules = (method, "gnmt") if isinstance(method, str) else method
    kw = dict(max_new_tokens=5, method=method, beam_rules=rules, beam_size=2, alpha=0.0)
    kw.update(rng=jax.random.key(4), temperature=3.0)  # sampling: far from greedy
    tokens, scores = decode.generate(model, {}, prompts, eos_id=(E1, E2), pad_id=1, **kw)
    ends = decode.first_eos(tokens, [E1, E2])
    assert (ends < 5).all()
    for b, end in enumerate(ends):
        eos = int(tokens[b, end])
        alone, alone_scores = decode.generate(model, {}, prompts, eos_id=eos, pad_id=1, **kw)
        np.testing.assert_array_equal(tokens[b], alone[b])  # filler 1 after the EOS
        np.testing.assert_allclose(scores[b], alone_scores[b], atol=1e-6)
    if method != "sample":
        assert tokens.tolist() == [[0, 4, E1, 1, 1], [E2, 1, 1, 1, 1]]
        np.testing.assert_allclose(scores, np.log([0.63, 0.9]), atol=1e-5)
        assert decode.first_eos(tokens, (E1, E2)).tolist() == [2, 0]
    else:
        assert {int(tokens[b, e]) for b, e in enumerate(ends)} == {E1, E2}  # each ends a row


def _fsdp_layouts(model, method):
    """{layout: generate's (tokens, scores)} from float32 parameters FSDP-sharded over the 8
    host devices."""
    from tfjax import sharding

    mesh = sharding.make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
    rules = sharding.DEFAULT_RULES
    prompts = jax.random.randint(jax.random.key(1), (8, 5), 1, 256)
    with sharding.logical_context(mesh, rules):
        boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), prompts))["params"]
        where = sharding.logical_shardings(boxed, mesh, rules)
        init = jax.jit(
            lambda: model.init(jax.random.key(0), prompts)["params"], out_shardings=where
        )
        params = nn.unbox(init())
        prompts = jax.device_put(prompts, sharding.batch_sharding(mesh, rules, 2))
        out = {
            layout: decode.generate(
                model,
                params,
                prompts,
                max_new_tokens=6,
                eos_id=255,
                method=method,
                layout=layout,
                beam_size=2,
            )  # fmt: skip
            for layout in decode.LAYOUTS
        }
        with pytest.raises(decode.OptionError, match="layout='fsdp' is unknown; allowed"):
            decode.generate(model, params, prompts, max_new_tokens=2, eos_id=255, layout="fsdp")
    return params, out


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_every_parameter_layout_generates_the_same_tokens(method):
    """bf16 compute: the token loop's layouts (cast once and replicated, split over the mesh,
    or as given) decode alike, for greedy and for beam search."""
    model = decoder.Model(
        variant="tiny", vocab_size=256, width=64, num_heads=8, num_kv_heads=8, mlp_dim=128,
        max_len=32, dtype=jnp.bfloat16, scan_layers=True,
    )  # fmt: skip
    params, out = _fsdp_layouts(model, method)
    base, base_scores = out["as-given"]
    for layout, (got, scores) in out.items():
        np.testing.assert_array_equal(got, base, err_msg=layout)
        # Split over the mesh, a contraction over heads or mlp sums its bf16 partial products
        # across devices in bf16: scores ~1e-4 apart; the cast alone changes none.
        rtol = 1e-3 if layout == "tensor" else 1e-6
        np.testing.assert_allclose(scores, base_scores, rtol=rtol, err_msg=layout)
    plan = decode.decode_layout(model, params, "replicated")
    cast = {d for d in plan.dtypes if d is not None}
    assert cast == {jnp.dtype(jnp.bfloat16)} and plan.dtypes.count(None) > 0  # norms keep f32


def test_a_mixture_decodes_alike_in_every_layout():
    """Its experts' kernels split along mlp under "tensor" (what "auto" takes for Mixtral and
    Qwen3-MoE on v5p): in float32 every layout gives the same tokens and scores."""
    model = decoder.Model(
        variant="moe-tiny", vocab_size=256, num_heads=8, num_kv_heads=8, mlp_dim=64,
        expert_mlp_dim=64, scan_layers=True,
    )  # fmt: skip
    _, out = _fsdp_layouts(model, "greedy")
    for layout, (got, scores) in out.items():
        np.testing.assert_array_equal(got, out["as-given"][0], err_msg=layout)
        np.testing.assert_allclose(scores, out["as-given"][1], rtol=1e-6, err_msg=layout)
