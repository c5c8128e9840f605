"""T5 v1.1 / Flan-T5 against transformers: logits, greedy generation and beam search with the
KV cache, round trips, refusals, and the published presets' parameter counts.

Small random models are built from configs (no download); float32 logits must be within 1e-5
of a float64 copy of the reference.
"""

import copy
import json
import math

import interop_references as references
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical, save_pretrained
from interop_references import ATOL, V, apply, torch, transformers

from tfjax import decode, interop
from tfjax.interop.core import tables
from tfjax.interop.families import t5
from tfjax.models import transformer

EOS = 1


def _config(**changes):
    """Three layers; 8 buckets up to a distance of 12, so the tests' 17 positions reach the
    log-spaced buckets and the shared last one."""
    return transformers.T5Config(
        **{
            **dict(
                vocab_size=V,
                d_model=32,
                d_kv=8,
                d_ff=48,
                num_layers=3,
                num_heads=4,
                feed_forward_proj="gated-gelu",
                tie_word_embeddings=False,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=12,
                dropout_rate=0.0,
                decoder_start_token_id=0,
            ),
            **changes,
        }
    )


def _randomise(ref):
    """An lm_head of its own (transformers >= 5 builds it tied), with EOS's row enlarged so that
    some outputs end before max_new_tokens, and norms away from one."""
    with torch.no_grad():
        ref.lm_head.weight = torch.nn.Parameter(0.3 * torch.randn_like(ref.lm_head.weight))
        ref.lm_head.weight[EOS] *= 1.2
        for name, p in ref.named_parameters():
            if "layer_norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return ref


@references.reference
def flan():
    torch.manual_seed(2)
    return _randomise(transformers.T5ForConditionalGeneration(_config()).eval())


def _sources(padding="right"):
    """[3, 17] source ids (no 0 or EOS inside), rows of 17, 11 and 5 tokens, padded with 0."""
    rs = np.random.RandomState(0)
    src = rs.randint(2, V, (3, 17))
    for row, n in ((1, 11), (2, 5)):
        src[row] = 0
        if padding == "right":
            src[row, :n] = rs.randint(2, V, n)
        else:
            src[row, -n:] = rs.randint(2, V, n)
    return src


def _targets():
    """[3, 15] target ids for the three sources (no 0 or EOS inside)."""
    return np.random.RandomState(1).randint(2, V, (3, 15))


def _mask(ids):
    return torch.tensor((ids != 0).astype(np.int64))


def _reference_logits(ref, src, tgt):
    """The reference's teacher-forced logits, in float64."""
    ref64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        return ref64(
            input_ids=torch.tensor(src),
            attention_mask=_mask(src),
            decoder_input_ids=ref64._shift_right(torch.tensor(tgt)),
        ).logits.numpy()


def _until_eos(tokens):
    """Each row up to and including its first EOS (transformers fills the rest with EOS when
    pad is 0, tfjax with 0)."""
    rows = []
    for row in np.asarray(tokens):
        ends = np.flatnonzero(row == EOS)
        rows.append(tuple(row[: ends[0] + 1] if ends.size else row))
    return rows


def _after_eos_is_padding(tokens):
    for row in np.asarray(tokens):
        ends = np.flatnonzero(row == EOS)
        if ends.size:
            assert (row[ends[0] + 1 :] == 0).all(), row


def test_the_fixture_is_what_it_tests(flan):
    model, _ = interop.load(flan[1])
    assert isinstance(model, transformer.Transformer)
    assert (model.position, model.relative_buckets, model.relative_max_distance) == (
        "relative",
        8,
        12,
    )
    assert (model.norm, model.activation, model.use_bias, model.tied) == (
        "rms",
        "geglu_tanh",
        False,
        False,
    )
    assert model.attention_scale == 1.0 and not model.scale_embeddings


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_logits_match_reference(flan, scan_layers, padding):
    ref, path = flan
    model, params = interop.load(path, scan_layers=scan_layers)
    src = _sources(padding)
    tgt = _targets()
    tgt[1, 9:] = 0
    want = _reference_logits(ref, src, tgt)
    got = apply(model, params, jnp.asarray(src), jnp.asarray(tgt))
    valid = tgt != 0  # right-padded targets: the positions before the padding
    np.testing.assert_allclose(got[valid], want[valid], atol=ATOL, rtol=0)


def test_packed_rows_equal_the_pairs_apart(flan):
    """Two source-target pairs packed in one row (segment ids, positions restarting) give each
    pair's own logits: T5's relative bias depends only on offsets within a segment."""
    _, path = flan
    model, params = interop.load(path)
    rs = np.random.RandomState(4)
    src = [rs.randint(2, V, n) for n in (9, 6)]
    tgt = [rs.randint(2, V, n) for n in (7, 5)]

    def packed(parts):
        ids = np.concatenate(parts)[None]
        segments = np.concatenate([np.full(len(x), i + 1) for i, x in enumerate(parts)])[None]
        positions = np.concatenate([np.arange(len(x)) for x in parts])[None]
        return ids, segments, positions

    (si, ss, sp), (ti, ts, tp) = packed(src), packed(tgt)
    got, _ = model.apply(
        {"params": params},
        si,
        ti,
        inputs_segment_ids=ss,
        targets_segment_ids=ts,
        inputs_positions=sp,
        targets_positions=tp,
    )
    apart = [apply(model, params, s[None], t[None])[0] for s, t in zip(src, tgt, strict=True)]
    np.testing.assert_allclose(np.asarray(got)[0], np.concatenate(apart), atol=1e-5, rtol=0)


def test_dropout_is_where_transformers_has_it(flan, tmp_path):
    """config.json's dropout_rate: embeddings, sub-layers, attention weights, the FFN's hidden
    activations and each stack's output; training with it differs from training without each."""
    _, path = flan
    model, params = interop.load(path, dropout_rate=0.3)
    assert (model.attention_dropout_rate, model.mlp_dropout_rate) == (0.0, 0.0)  # the file's
    assert model.output_dropout
    config = {**interop.read_config(path), "dropout_rate": 0.3}
    model = t5.from_t5(interop.read_state_dict(path), config)[0]
    assert (model.dropout_rate, model.attention_dropout_rate, model.mlp_dropout_rate) == (
        0.3,
        0.3,
        0.3,
    )
    src, tgt = _sources(), _targets()

    def train(m):
        rngs = {"dropout": jax.random.key(0)}
        return np.asarray(m.apply({"params": params}, src, tgt, train=True, rngs=rngs)[0])

    full = train(model)
    for off in (
        dict(attention_dropout_rate=0.0),
        dict(mlp_dropout_rate=0.0),
        dict(output_dropout=False),
    ):
        assert np.abs(train(model.clone(**off)) - full).max() > 1e-3, off
    # the export writes dropout_rate alone: a model whose rates differ still saves
    interop.save(model.clone(attention_dropout_rate=0.0), params, tmp_path)
    assert interop.read_config(tmp_path)["dropout_rate"] == 0.3


def test_the_relative_bias_and_the_head_are_in_the_compared_logits(flan):
    """Zeroing either bias table, or using the embedding as the head, changes the logits."""
    _, path = flan
    model, params = interop.load(path)
    src, tgt = _sources(), _targets()
    base = apply(model, params, src, tgt)
    for name in ("encoder_position_bias", "decoder_position_bias"):
        changed = {**params, name: {"embedding": jnp.zeros_like(params[name]["embedding"])}}
        assert np.abs(apply(model, changed, src, tgt) - base).max() > 1e-2, name
    tied = model.clone(tie_embeddings=True)
    untied = {k: v for k, v in params.items() if k != "output_proj"}
    assert np.abs(apply(tied, untied, src, tgt) - base).max() > 1e-2


def _hf_generate(ref, src, **kwargs):
    with torch.no_grad():
        out = ref.generate(
            input_ids=torch.tensor(src),
            attention_mask=_mask(src),
            max_new_tokens=12,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            **kwargs,
        )
    return out.sequences.numpy()[:, 1:], out  # without the start token


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_greedy_generation_matches_reference(flan, scan_layers, padding):
    ref, path = flan
    model, params = interop.load(path, scan_layers=scan_layers)
    src = _sources(padding)
    want, _ = _hf_generate(ref, src, num_beams=1)
    got, _ = decode.generate(model, params, src, max_new_tokens=12, eos_id=EOS)
    assert _until_eos(got) == _until_eos(want)
    _after_eos_is_padding(got)
    uncached, _ = decode.generate(
        model, params, src, max_new_tokens=12, eos_id=EOS, use_cache=False
    )
    np.testing.assert_array_equal(uncached, got)


def test_greedy_generation_reaches_eos_in_the_compared_rows(flan):
    """The fixture's greedy output ends some rows with EOS before max_new_tokens, and other
    rows run to the end: both the stop and the padding after it are compared above."""
    ref, _ = flan
    want, _ = _hf_generate(ref, _sources("right"), num_beams=1)
    lengths = [len(r) for r in _until_eos(want)]
    assert min(lengths) < 12 and max(lengths) == 12, lengths


# (early_stopping, length_penalty, num_beams): transformers' three stopping rules, a penalty
# that favours long, neutral-ish and short outputs.
BEAM_CASES = [(False, 1.0, 4), (False, -0.5, 2), (True, 0.6, 2), (True, 1.0, 4), ("never", 0.6, 3)]


@pytest.mark.parametrize("early_stopping,length_penalty,num_beams", BEAM_CASES)
def test_beam_search_matches_transformers_generate(flan, early_stopping, length_penalty, num_beams):
    ref, path = flan
    model, params = interop.load(path, scan_layers=True)
    src = _sources("right")
    want, out = _hf_generate(
        ref, src, num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping
    )
    got, scores = decode.generate(
        model,
        params,
        src,
        max_new_tokens=12,
        eos_id=EOS,
        method="beam",
        beam_size=num_beams,
        alpha=length_penalty,
        beam_rules="hf",
        early_stopping=early_stopping,
    )
    assert _until_eos(got) == _until_eos(want)
    _after_eos_is_padding(got)
    np.testing.assert_allclose(scores, out.sequences_scores.numpy(), rtol=1e-5)


def test_each_early_stopping_rule_matches_transformers_where_they_differ(flan):
    """Sources and settings where transformers' three stopping rules give three outputs."""
    ref, path = flan
    model, params = interop.load(path)
    src = np.random.RandomState(1).randint(2, V, (4, 9))
    outputs = set()
    for early_stopping in (False, True, "never"):
        want, out = _hf_generate(
            ref, src, num_beams=3, length_penalty=1.0, early_stopping=early_stopping
        )
        got, scores = decode.generate(
            model,
            params,
            src,
            max_new_tokens=12,
            eos_id=EOS,
            method="beam",
            beam_size=3,
            alpha=1.0,
            beam_rules="hf",
            early_stopping=early_stopping,
        )
        assert _until_eos(got) == _until_eos(want), early_stopping
        np.testing.assert_allclose(scores, out.sequences_scores.numpy(), rtol=1e-5)
        outputs.add(tuple(_until_eos(want)))
    assert len(outputs) == 3


def test_beam_search_cases_differ_from_greedy_and_from_each_other(flan):
    """The parametrized beam cases above are not all the greedy output in disguise, and some
    of their outputs end with EOS in the middle of the 12 steps."""
    ref, _ = flan
    src = _sources("right")
    outputs = {tuple(_until_eos(_hf_generate(ref, src, num_beams=1)[0]))}
    lengths = set()
    for es, lp, k in BEAM_CASES:
        rows = _until_eos(
            _hf_generate(ref, src, num_beams=k, length_penalty=lp, early_stopping=es)[0]
        )
        outputs.add(tuple(rows))
        lengths.update(len(r) for r in rows)
    assert len(outputs) >= 3, outputs
    assert any(1 < n < 12 for n in lengths), lengths


def test_round_trip_is_bit_exact_and_transformers_reads_it(flan, tmp_path):
    ref, path = flan
    model, params = interop.load(path, scan_layers=True)
    interop.save(model, params, tmp_path)
    model2, params2 = interop.load(tmp_path, scan_layers=True)
    assert model2 == model
    assert_params_identical(params, params2)
    original, exported = interop.read_state_dict(path), interop.read_state_dict(tmp_path)
    assert set(exported) == set(original)
    for key, value in exported.items():
        assert np.array_equal(value, original[key]), key
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    src = _sources()
    assert _until_eos(_hf_generate(back, src, num_beams=2)[0]) == _until_eos(
        _hf_generate(ref, src, num_beams=2)[0]
    )
    assert not torch.equal(back.lm_head.weight, back.shared.weight)


def test_a_file_without_lm_head_loads_tied(tmp_path):
    """transformers >= 5 ties a v1.1 head to `shared` (unscaled) and saves no lm_head."""
    torch.manual_seed(1)
    ref = transformers.T5ForConditionalGeneration(_config()).eval()
    save_pretrained(ref, tmp_path)
    assert "lm_head.weight" not in interop.read_state_dict(tmp_path)
    model, params = interop.load(tmp_path)
    assert model.tied and "output_proj" not in params
    src, tgt = _sources(), _targets()
    want = _reference_logits(ref, src, tgt)
    got = apply(model, params, src, tgt)
    # The tied head (shared embeddings of std 1, unscaled) makes logits up to |15|: float32's
    # rounding of the hidden states then moves whole rows by ~1.5e-5 on some CPUs. The bound
    # is ATOL of the logits' scale.
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=ATOL * scale, rtol=0)
    interop.save(model, params, tmp_path / "out")
    assert "lm_head.weight" not in interop.read_state_dict(tmp_path / "out")


def _edited(path, tmp_path, **changes):
    config = interop.read_config(path)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    return interop.read_state_dict(path), config


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(scale_decoder_outputs=True), "scale_decoder_outputs=True is not supported"),
        (
            dict(scale_decoder_outputs=None, tie_word_embeddings=None),
            "no tie_word_embeddings \\(meaning true\\) is not supported",
        ),
        (
            dict(scale_decoder_outputs=None, tie_word_embeddings=True),
            "tie_word_embeddings=True is not supported .*original T5",
        ),
        (dict(num_decoder_layers=2), "num_layers=3 differs from num_decoder_layers=2"),
        (
            dict(feed_forward_proj="gated-relu"),
            "feed_forward_proj='gated-relu' is not supported; allowed: .*'gated-gelu'",
        ),
        (dict(pad_token_id=5), "pad_token_id=5 is not supported .*tfjax pads with id 0"),
        (dict(decoder_start_token_id=2), "decoder_start_token_id=2 is not supported"),
        (
            dict(d_kv=4),
            "'encoder.block.0.layer.0.SelfAttention.q.weight' in .* has shape "
            r"\(32, 32\), but the model built from the config expects \(16, 32\)",
        ),
    ],
)
def test_refusals_name_the_key_and_what_is_allowed(flan, tmp_path, changes, message):
    _, path = flan
    state, config = _edited(path, tmp_path, **changes)
    with pytest.raises(ValueError, match=f"T5ForConditionalGeneration: {message}"):
        t5.from_t5(state, config)


def test_export_refuses_a_model_t5_cannot_express():
    model = transformer.Model(
        variant="flan-t5-small",
        vocab_size=V,
        width=32,
        num_layers=2,
        num_heads=4,
        mlp_dim=48,
        activation="geglu",
    )
    with pytest.raises(ValueError, match="no feed_forward_proj for the model's activation='geglu'"):
        t5.to_t5(model, {})
    model = transformer.Model(variant="flan-t5-small", vocab_size=V, use_bias=True)
    with pytest.raises(ValueError, match="T5ForConditionalGeneration needs .*use_bias"):
        t5.to_t5(model, {})


def test_the_papers_layouts_refuse_a_t5_model():
    """Marian and torch.nn.Transformer have none of T5's fields: their exports say so."""
    model = transformer.Model(variant="flan-t5-small", vocab_size=V, norm_position="post")
    with pytest.raises(ValueError, match="MarianMTModel needs a model with .*'relative'"):
        interop.to_marian(model, {})
    with pytest.raises(ValueError, match="torch.nn.Transformer is the paper's layout"):
        interop.to_torch_transformer(model, {})


# ----------------------------------------------------------------------------------------------
# Presets: parameter counts from shapes alone.

# The Flan-T5 paper (Chung et al., 2022, Table 2) gives 80M, 250M, 780M, 3B and 11B; the
# checkpoints' exact counts are transformers' model of each preset's exported config.
PAPER = {"small": 80e6, "base": 250e6, "large": 780e6, "xl": 3e9, "xxl": 11e9}


def _count(model) -> int:
    shapes = jax.eval_shape(model.init, jax.random.key(0), tables.TOKENS, tables.TOKENS)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


@pytest.mark.parametrize("size", sorted(PAPER))
def test_flan_t5_presets_are_transformers_models_of_their_exported_config(size):
    model = transformer.Model(variant=f"flan-t5-{size}")
    config = tables.hf_config(t5.T5, t5.spelled_out(model))
    del config["architectures"], config["model_type"]
    config = transformers.T5Config(**config)
    with torch.device("meta"):
        reference = transformers.T5ForConditionalGeneration(config)
    # transformers ties lm_head to shared unless the weights differ: count it once more
    n = sum(p.numel() for p in reference.parameters()) + reference.lm_head.weight.numel()
    assert n == _count(model)
    # the paper's rounded sizes (80M for 77M, 3B for 2.85B)
    assert abs(n / PAPER[size] - 1) < 0.06, n
