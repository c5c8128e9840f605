"""torch.nn.Transformer with embeddings and torch.nn.MultiheadAttention
(tfjax.interop.families.torch_nn) against PyTorch: outputs with masks, logits, greedy decoding,
bitwise round trips (also back into the torch module), every module attribute that changes the
outputs read (logits as torch's) or refused by name, and bad input."""

import math
import os
import warnings

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical, module_fields
from interop_references import ATOL, V, assert_rows_end_at_eos, seq2seq_batch, torch

from tfjax import decode, interop
from tfjax.interop.families import torch_nn


def test_mha_self_attention_with_masks():
    torch.manual_seed(5)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    mha, params = interop.from_torch_mha(ref)
    x = np.random.RandomState(0).randn(2, 6, 16).astype(np.float32)
    pad = np.zeros((2, 6), bool)
    pad[1, 4:] = True  # torch: True = ignore this key
    causal = np.triu(np.ones((6, 6), bool), 1)
    with torch.no_grad():
        want = ref(
            *(torch.tensor(x),) * 3,
            key_padding_mask=torch.tensor(pad),
            attn_mask=torch.tensor(causal),
            need_weights=False,
        )[0].numpy()
    mask = jnp.asarray(~pad)[:, None, None, :] & jnp.asarray(~causal)[None, None]
    got = np.asarray(mha.apply({"params": params}, jnp.asarray(x), mask=mask))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    exported = interop.to_torch_mha(mha, params)
    assert exported.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert np.array_equal(exported[k], v.numpy()), k


def test_mha_cross_attention_other_width_no_bias():
    torch.manual_seed(6)
    ref = torch.nn.MultiheadAttention(16, 2, kdim=12, vdim=12, bias=False, batch_first=True)
    ref.eval()
    mha, params = interop.from_torch_mha(ref)
    assert not mha.config.use_bias and params["key_kernel"].shape == (12, 2, 8)
    rs = np.random.RandomState(1)
    x, ctx = rs.randn(2, 5, 16).astype(np.float32), rs.randn(2, 7, 12).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.tensor(x), torch.tensor(ctx), torch.tensor(ctx), need_weights=False)[0]
    got = mha.apply({"params": params}, jnp.asarray(x), jnp.asarray(ctx))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=ATOL, rtol=0)
    # The state dict route needs num_heads and gives the same parameters.
    _, from_state = interop.from_torch_mha(ref.state_dict(), num_heads=2)
    assert_params_identical(params, from_state)
    exported = interop.to_torch_mha(mha, params)
    assert sorted(exported) == sorted(ref.state_dict())


def test_mha_time_first_module_and_its_dropout():
    """batch_first=False only changes the layout torch takes ([T, B, D]); the dropout rate on
    the attention weights is the module's."""
    torch.manual_seed(7)
    ref = torch.nn.MultiheadAttention(16, 4, dropout=0.3).eval()
    mha, params = interop.from_torch_mha(ref)
    assert mha.config.dropout_rate == 0.3
    x = np.random.RandomState(2).randn(5, 2, 16).astype(np.float32)  # [T, B, D]
    with torch.no_grad():
        want = ref(*(torch.tensor(x),) * 3, need_weights=False)[0].numpy()
    got = mha.apply({"params": params}, jnp.asarray(x.transpose(1, 0, 2)))
    np.testing.assert_allclose(np.asarray(got).transpose(1, 0, 2), want, atol=ATOL, rtol=0)


class _OwnAttention(torch.nn.MultiheadAttention):
    def forward(self, query, *args, **kwargs):
        return super().forward(query.flip(1), *args, **kwargs)


@pytest.mark.parametrize(
    ("module", "kwargs", "message"),
    [
        (dict(add_bias_kv=True), {}, r"MultiheadAttention has add_bias_kv=True"),
        (dict(add_zero_attn=True), {}, r"MultiheadAttention has add_zero_attn=True"),
        (dict(kdim=12, vdim=10), {}, r"kdim=12 != vdim=10; tfjax's cross-attention takes one"),
        ({}, dict(num_heads=2), r"num_heads=2, but the module has num_heads=4; leave num_heads"),
        (None, {}, r"_OwnAttention, a subclass with its own forward of torch\.nn\.Multihead"),
    ],
    ids=["add_bias_kv", "add_zero_attn", "kdim != vdim", "num_heads", "own forward"],
)
def test_mha_module_attributes_refused_by_name(module, kwargs, message):
    if module is None:
        ref = _OwnAttention(8, 4)
    else:
        ref = torch.nn.MultiheadAttention(8, 4, **module)
    with pytest.raises(ValueError, match=message):
        interop.from_torch_mha(ref, **kwargs)


def test_mha_state_dict_without_its_projections():
    """Each names the missing keys and what a MultiheadAttention state dict holds."""
    state = torch.nn.MultiheadAttention(8, 2).state_dict()
    del state["in_proj_weight"]
    with pytest.raises(
        ValueError,
        match=r"^torch\.nn\.MultiheadAttention: 'in_proj_weight' missing from <state dict>, "
        r"which holds 'in_proj_bias', 'out_proj\.bias', 'out_proj\.weight'; expected "
        r"in_proj_weight \[3D, D\] \(or q_proj_weight",
    ):
        interop.from_torch_mha(state, num_heads=2)
    state = torch.nn.MultiheadAttention(8, 2, kdim=6, vdim=6).state_dict()
    del state["v_proj_weight"], state["out_proj.weight"]
    with pytest.raises(ValueError, match=r"'out_proj\.weight', 'v_proj_weight' missing from"):
        interop.from_torch_mha(state, num_heads=2)
    with pytest.raises(ValueError, match=r"a state dict does not hold the number of heads"):
        interop.from_torch_mha(state)
    state = torch.nn.MultiheadAttention(8, 2).state_dict()
    del state["in_proj_bias"]  # out_proj.bias says bias=True
    with pytest.raises(ValueError, match=r"1 key\(s\) missing from <state dict>: 'in_proj_bias'"):
        interop.from_torch_mha(state, num_heads=2)


# ----------------------------------------------------------------------------------------------
# torch.nn.Transformer with embeddings.


class _TorchSeq2Seq(torch.nn.Module):
    """The paper's model in plain PyTorch: nn.Embedding * sqrt(D) + interleaved sinusoids (as in
    PyTorch's tutorial), a post-LN ReLU nn.Transformer without final norms, and the output
    projection (the embedding matrix when shared)."""

    def __init__(self, *, shared, std=0.25, width=32, heads=4, mlp=48, layers=2):
        super().__init__()
        self.width = width
        self.embed = torch.nn.Embedding(V, width)
        if not shared:
            self.target_embed = torch.nn.Embedding(V, width)
            self.output = torch.nn.Linear(width, V, bias=False)
        kw = dict(
            dim_feedforward=mlp, dropout=0.0, activation="relu", batch_first=True, norm_first=False
        )
        layer = torch.nn.TransformerEncoderLayer(width, heads, **kw)
        encoder = torch.nn.TransformerEncoder(layer, layers, norm=None, enable_nested_tensor=False)
        decoder = torch.nn.TransformerDecoder(
            torch.nn.TransformerDecoderLayer(width, heads, **kw), layers, norm=None
        )
        self.transformer = torch.nn.Transformer(
            width, heads, custom_encoder=encoder, custom_decoder=decoder, batch_first=True
        )
        pos = torch.arange(64, dtype=torch.float32)[:, None]
        angles = pos * 10_000.0 ** (-torch.arange(0, width, 2, dtype=torch.float32) / width)
        pe = torch.stack([torch.sin(angles), torch.cos(angles)], -1).reshape(64, width)
        self.register_buffer("pe", pe, persistent=False)
        with torch.no_grad():  # every layer different, norms not the identity
            for name, p in self.named_parameters():
                base = float(name.endswith("weight") and ".norm" in name)
                p.copy_(base + std * torch.randn_like(p))

    def forward(self, inputs, decoder_inputs):
        scale = math.sqrt(self.width)
        target_embed = getattr(self, "target_embed", self.embed)
        x = self.embed(inputs) * scale + self.pe[: inputs.shape[1]]
        y = target_embed(decoder_inputs) * scale + self.pe[: decoder_inputs.shape[1]]
        t = decoder_inputs.shape[1]
        time_first = not self.transformer.batch_first  # [S, B, D] in, [T, B, D] out
        if time_first:
            x, y = x.transpose(0, 1), y.transpose(0, 1)
        y = self.transformer(
            x,
            y,
            tgt_mask=torch.triu(torch.ones(t, t, dtype=torch.bool), 1),
            src_key_padding_mask=inputs == 0,
            memory_key_padding_mask=inputs == 0,
            tgt_is_causal=True,
        )
        if time_first:
            y = y.transpose(0, 1)
        if hasattr(self, "output"):
            return self.output(y)
        return y @ self.embed.weight.T


def _logits_of(ref):
    """The torch module's logits as a function of numpy ids."""

    def logits(inputs, decoder_inputs):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nested tensors' fast path: "prototype stage"
            return ref(torch.tensor(inputs), torch.tensor(decoder_inputs)).numpy()

    return logits


def _torch_seq2seq(shared, seed=9, std=0.25):
    torch.manual_seed(seed)
    return _TorchSeq2Seq(shared=shared, std=std).eval()


@pytest.mark.parametrize(("shared", "scan_layers"), [(True, False), (False, True)])
def test_transformer_logits_match_reference(shared, scan_layers):
    ref = _torch_seq2seq(shared)
    model, params = interop.from_torch_transformer(ref, num_heads=4, scan_layers=scan_layers)
    assert model.share_embeddings == shared and model.num_layers == 2 and model.mlp_dim == 48
    references.check_seq2seq_logits(model, params, _logits_of(ref))


def test_transformer_greedy_decoding_matches_reference():
    """The torch module has no generate: a greedy loop over the whole prefix is the reference."""
    ref = _torch_seq2seq(shared=False, seed=11, std=0.1)  # larger weights repeat one token
    model, params = interop.from_torch_transformer(ref, num_heads=4)
    rs = np.random.RandomState(3)
    sources, max_new = rs.randint(3, V, (3, 6)), 10
    sources[1, 3:] = 0
    tokens = torch.zeros((3, 1), dtype=torch.long)
    with torch.no_grad():
        for _ in range(max_new):
            logits = ref(torch.tensor(sources), tokens)[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    want = tokens[:, 1:].numpy()
    assert len(set(want.ravel().tolist())) > 5, "degenerate reference; change the seed"
    eos = int(want[0, max_new // 2])  # rows stop at their first EOS; tfjax pads with 0 after
    got, _ = decode.generate(model, params, sources, max_new_tokens=max_new, eos_id=eos)
    assert_rows_end_at_eos(np.asarray(got), want, eos)


def test_transformer_round_trip_is_bitwise(tmp_path):
    ref = _torch_seq2seq(shared=True)
    model, params = interop.from_torch_transformer(ref, num_heads=4)
    state = interop.to_torch_transformer(model, params)
    assert state.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert np.array_equal(state[k], v.numpy()), k
    interop.write_safetensors(state, tmp_path)
    model2, params2 = interop.from_torch_transformer(tmp_path, num_heads=4)
    dropouts = dict.fromkeys(torch_nn.DROPOUT_FIELDS, 0.0)  # the module's; weights have none
    assert module_fields(model2.clone(**dropouts)) == module_fields(model)
    assert_params_identical(params, params2)
    # The exported state dict loads back into the torch module.
    again = _TorchSeq2Seq(shared=True).eval()
    again.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    inputs, _, decoder_inputs = seq2seq_batch()
    with torch.no_grad():
        want = ref(torch.tensor(inputs), torch.tensor(decoder_inputs))
        np.testing.assert_array_equal(
            again(torch.tensor(inputs), torch.tensor(decoder_inputs)).numpy(), want.numpy()
        )


def test_transformer_bad_input(tmp_path):
    ref = _torch_seq2seq(shared=False)
    state = dict(ref.state_dict())
    with pytest.raises(ValueError, match=r"num_heads=5 does not divide the width 32"):
        interop.from_torch_transformer(state, num_heads=5)
    # Weights of another size than the embedding says: the key, its shape and the expected one.
    interop.write_safetensors(
        {**state, "transformer.encoder.layers.1.linear2.weight": torch.zeros(32, 40)}, tmp_path
    )
    with pytest.raises(
        ValueError,
        match=r"'transformer\.encoder\.layers\.1\.linear2\.weight' in .*model\.safetensors has "
        r"shape \(32, 40\).*\(32, 48\)",
    ):
        interop.from_torch_transformer(tmp_path, num_heads=4)
    with pytest.raises(ValueError, match=r"unexpected key.*'output\.bias'"):
        interop.from_torch_transformer({**state, "output.bias": torch.zeros(V)}, num_heads=4)
    with pytest.raises(FileNotFoundError, match=r"no weights in .*empty.*model\.safetensors"):
        os.makedirs(tmp_path / "empty")
        interop.from_torch_transformer(tmp_path / "empty", num_heads=4)


def _torch_transformer(seed=13, **options):
    """_TorchSeq2Seq (shared embeddings) around torch.nn.Transformer's own stacks of one layer
    each, final norms included, with `options` changed; weights away from their init."""
    torch.manual_seed(seed)
    ref = _TorchSeq2Seq(shared=True)
    kwargs = dict(d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1)
    kwargs |= dict(dim_feedforward=48, dropout=0.0, batch_first=True) | options
    with warnings.catch_warnings():  # nested tensors turned off by norm_first, batch_first
        warnings.simplefilter("ignore")
        ref.transformer = torch.nn.Transformer(**kwargs)
    with torch.no_grad():
        for p in ref.transformer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return ref.eval()


# Each changes one attribute of torch's default (post-LN, ReLU, 4 heads, eps 1e-5, batch-first).
# Read as the defaults, each but batch_first (the layout torch takes, not the maths) moves the
# logits by 0.03 (eps) to 4.4 (norm_first), far more than ATOL (measured).
HONOURED = {
    "defaults": {},  # its own stacks end in a LayerNorm each: final_norm=True
    "norm_first": dict(norm_first=True),
    "gelu": dict(activation="gelu"),
    "callable": dict(activation=torch.nn.functional.silu),
    "nhead": dict(nhead=2),
    "layer_norm_eps": dict(layer_norm_eps=1e-2),
    "batch_first": dict(batch_first=False),
}


@pytest.mark.parametrize("options", HONOURED.values(), ids=HONOURED)
def test_transformer_module_attributes_are_honoured(options):
    """Each attribute that changes torch's outputs is read from the module (no arguments)."""
    ref = _torch_transformer(**options)
    model, params = interop.from_torch_transformer(ref)
    assert model.final_norm and model.num_layers == 1
    references.check_seq2seq_logits(model, params, _logits_of(ref), jit=False)
    if options == {}:
        state = interop.to_torch_transformer(model, params)
        assert state.keys() == ref.state_dict().keys()


def test_transformer_dropout_rates_come_from_the_module():
    """Dropout changes training, not outputs: the model trains with the module's rates, unless
    the caller sets them."""
    ref = _torch_seq2seq(shared=True)
    for layer in (*ref.transformer.encoder.layers, *ref.transformer.decoder.layers):
        layer.dropout.p = 0.3  # on the FFN's hidden activations
        for name in ("dropout1", "dropout2", "dropout3"):  # on each sub-layer's output
            if hasattr(layer, name):
                getattr(layer, name).p = 0.1
        for attention in ("self_attn", "multihead_attn"):  # on the attention weights
            if hasattr(layer, attention):
                getattr(layer, attention).dropout = 0.2
    model, _ = interop.from_torch_transformer(ref)
    rates = (model.dropout_rate, model.attention_dropout_rate, model.mlp_dropout_rate)
    assert rates == (0.1, 0.2, 0.3)
    model, _ = interop.from_torch_transformer(ref, mlp_dropout_rate=0.0)
    assert model.mlp_dropout_rate == 0.0


class _OwnForward(torch.nn.TransformerEncoderLayer):
    def forward(self, src, *args, **kwargs):
        return super().forward(2 * src, *args, **kwargs)


def _refusals():
    """(what is changed, a function changing a fresh module and converting it, the message)."""
    nn = torch.nn

    def layer(side, i=0):
        return lambda ref: getattr(ref.transformer, side).layers[i]

    def no_final_norms(ref):  # the custom stacks of _TorchSeq2Seq with norm_first
        for side in ("encoder", "decoder"):
            for lay in getattr(ref.transformer, side).layers:
                lay.norm_first = True

    def set_attr(get, name, value):
        return lambda ref: setattr(get(ref), name, value)

    return {
        "bias": (
            lambda ref: setattr(ref, "transformer", _torch_transformer(bias=False).transformer),
            r"transformer\.encoder\.norm has no bias \(bias=False\)",
        ),
        "activation": (
            set_attr(layer("encoder"), "activation", torch.tanh),
            r"transformer\.encoder\.layers\.0\.activation is <built-in method tanh.*it takes "
            r"relu",
        ),
        "activation module": (  # torch's deep copies of a decoder layer compute relu instead
            lambda ref: setattr(
                ref,
                "transformer",
                _torch_transformer(activation=nn.GELU(approximate="tanh")).transformer,
            ),
            r"differ in activation \(transformer\.encoder\.layers\.0: 'gelu_tanh', "
            r"transformer\.decoder\.layers\.0: 'relu'\)",
        ),
        "norm_first without final norms": (
            no_final_norms,
            r"norm_first=True stacks without final norms",
        ),
        "norm_first in one layer": (
            set_attr(layer("decoder", 1), "norm_first", True),
            r"differ in norm_first \(transformer\.encoder\.layers\.0: False, "
            r"transformer\.decoder\.layers\.1: True\)",
        ),
        "layer_norm_eps in one norm": (
            set_attr(lambda ref: ref.transformer.decoder.layers[0].norm3, "eps", 1e-3),
            r"differ in layer_norm_eps .*transformer\.decoder\.layers\.0\.norm3: 0\.001",
        ),
        "nhead in one layer": (
            set_attr(
                layer("encoder", 1), "self_attn", nn.MultiheadAttention(32, 2, batch_first=True)
            ),
            r"differ in nhead \(transformer\.encoder\.layers\.0\.self_attn: 4, "
            r"transformer\.encoder\.layers\.1\.self_attn: 2\)",
        ),
        "add_zero_attn": (
            set_attr(
                layer("decoder"), "multihead_attn", nn.MultiheadAttention(32, 4, add_zero_attn=True)
            ),
            r"transformer\.decoder\.layers\.0\.multihead_attn has add_zero_attn=True",
        ),
        "add_bias_kv": (
            set_attr(layer("encoder"), "self_attn", nn.MultiheadAttention(32, 4, add_bias_kv=True)),
            r"transformer\.encoder\.layers\.0\.self_attn has add_bias_kv=True",
        ),
        "elementwise_affine": (
            set_attr(layer("encoder"), "norm1", nn.LayerNorm(32, elementwise_affine=False)),
            r"transformer\.encoder\.layers\.0\.norm1 has elementwise_affine=False",
        ),
        "batch_first in one layer": (
            set_attr(layer("decoder"), "self_attn", nn.MultiheadAttention(32, 4)),
            r"differ in batch_first \(transformer: True, transformer\.decoder\.layers\.0\."
            r"self_attn: False\)",
        ),
        "a layer with its own forward": (
            lambda ref: ref.transformer.encoder.layers.__setitem__(
                0, _OwnForward(32, 4, 48, 0.0, batch_first=True)
            ),
            r"transformer\.encoder\.layers\.0 is a _OwnForward, a subclass with its own "
            r"forward of torch\.nn\.TransformerEncoderLayer",
        ),
        "an RMSNorm": (
            set_attr(lambda ref: ref.transformer.encoder, "norm", nn.RMSNorm(32)),
            r"transformer\.encoder\.norm is a RMSNorm, not one of torch\.nn\.LayerNorm",
        ),
        "max_norm": (
            set_attr(lambda ref: ref.embed, "max_norm", 1.0),
            r"embed has max_norm=1\.0, which rescales its rows",
        ),
    }


REFUSED = _refusals()


@pytest.mark.parametrize(("change", "message"), REFUSED.values(), ids=REFUSED)
def test_transformer_module_attributes_refused_by_name(change, message):
    ref = _torch_seq2seq(shared=True)
    change(ref)
    with pytest.raises(ValueError, match=message):
        interop.from_torch_transformer(ref)


def test_transformer_arguments_that_contradict_the_module():
    ref = _torch_seq2seq(shared=True)  # nhead 4, relu, post-LN, eps 1e-5
    for kwargs, message in (
        (
            dict(num_heads=8),
            r"num_heads=8, but transformer\.encoder\.layers\.0\.self_attn has "
            r"nhead=4; leave num_heads out",
        ),
        (dict(activation="gelu"), r"activation='gelu', but .* has activation='relu'"),
        (dict(norm_first=True), r"norm_first=True, but .* has norm_first=False"),
        (
            dict(norm_position="pre"),
            r"norm_position='pre' would change the outputs: the "
            r"module's attributes \(_TorchSeq2Seq\) give norm_position='post'",
        ),
        (dict(mlp_dim=64), r"mlp_dim=64 would change the outputs: the weights give mlp_dim=48"),
    ):
        with pytest.raises(ValueError, match=message):
            interop.from_torch_transformer(ref, **kwargs)
    # What weights alone do not hold, the arguments say.
    state = ref.state_dict()
    with pytest.raises(
        ValueError,
        match=r"weights alone \(<state dict>\) do not hold the "
        r"number of heads: pass num_heads=",
    ):
        interop.from_torch_transformer(state)
    with pytest.raises(ValueError, match=r"norm_first=True stacks without final norms"):
        interop.from_torch_transformer(state, num_heads=4, norm_first=True)
    with pytest.raises(ValueError, match=r"activation=<built-in method tanh.*it takes relu"):
        interop.from_torch_transformer(state, num_heads=4, activation=torch.tanh)
    with warnings.catch_warnings():  # nested tensors off: batch_first=False
        warnings.simplefilter("ignore")
        bare = torch.nn.Transformer(32, 4, 1, 1, 48)
    for module in (bare, ref.transformer.encoder):  # no embeddings
        with pytest.raises(
            ValueError, match=r"has no submodule 'transformer'; the converter reads"
        ):
            interop.from_torch_transformer(module)
