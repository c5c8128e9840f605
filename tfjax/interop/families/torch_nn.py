"""Plain PyTorch modules <-> tfjax: `torch.nn.Transformer` with embeddings <->
`tfjax.models.transformer`, and `torch.nn.MultiheadAttention` <-> `tfjax.nn.MultiHeadAttention`.

    model, params = from_torch_transformer(module)            # or a state dict / directory
    logits, _ = model.apply({"params": params}, inputs, targets)  # [B, S], [B, T] -> [B, T, V]
    state = to_torch_transformer(model, params)
    mha, params = from_torch_mha(torch_module)               # or (state_dict, num_heads=...)
    y = mha.apply({"params": params}, x)                     # self-attention, x [B, T, D]
    y = mha.apply({"params": params}, x, context, mask=m)    # cross-attention, one context

torch.nn.Transformer is the paper's layout (`core.encoder_decoder`): sinusoidal positions added
to token embeddings scaled by sqrt(d_model), LayerNorms placed after each sub-layer
(norm_first=False, the paper's post-LN) or before it (norm_first=True: tfjax's pre-LN), an FFN
with one activation (ReLU in the paper); its own stacks end in a LayerNorm each
(`final_norm=True`). Positions are the paper's interleaved sinusoids (as PyTorch's tutorial),
tfjax's own.

A module's attributes decide what its weights do not say, and the converter reads every one that
changes the outputs (`_read_module`): nhead, norm_first, activation, layer_norm_eps, the final
norms; the dropout rates become the model's (they change training, not the outputs). What tfjax
cannot compute the same way is refused by name: bias=False (tfjax's LayerNorms have biases),
an activation other than relu / gelu / gelu_tanh / silu, add_bias_kv, add_zero_attn, kdim or
vdim in the layers, a pre-LN stack without its final norm, layers that differ from each other,
an Embedding with max_norm, and any module that is not torch's own (a subclass with its own
forward) where the converter expects one. batch_first only decides the layout of the tensors a
module takes; tfjax's are batch-first. A state dict or a directory holds none of these: pass
num_heads (and activation, norm_eps, norm_first where they are not torch's defaults).

Key mapping, torch.nn.Transformer (under `prefix`), layer i:
  {en,de}coder.layers.i.self_attn.in_proj_weight [3D, D] (rows q, k, v)
                                           -> self_attention/{query,key,value}_kernel
  decoder.layers.i.multihead_attn.*         -> cross_attention/*
  encoder norm1, norm2 / decoder norm1, norm2, norm3
                                           -> self_attention_norm, (cross_attention_norm,)
                                              mlp_norm
  linear1, linear2                         -> mlp/wi, mlp/wo
  {en,de}coder.norm (nn.Transformer's final norms)
                                           -> {en,de}coder/final_norm (final_norm=True)
  `embed`, `target_embed`, `output` keys (outside nn.Transformer) -> embed, target_embed,
                                              output_proj
torch.nn.MultiheadAttention:
  in_proj_weight [3D, D] (rows q, k, v)          -> {query,key,value}_kernel [D, N, H]
  q_proj_weight, k_proj_weight, v_proj_weight     -> the same, when kdim = vdim != embed_dim
  in_proj_bias [3D]                               -> {query,key,value}_bias [N, H]
  out_proj.weight [D, D], out_proj.bias           -> out_kernel [N, H, D], out_bias
Masks: tfjax's `mask` is True where a query may attend; torch's key_padding_mask and boolean
attn_mask are True where it may not. add_bias_kv and add_zero_attn have no tfjax counterpart.
"""

import jax.numpy as jnp
import numpy as np

from tfjax.interop.core import files
from tfjax.interop.core.encoder_decoder import PAPER_LAYOUT, Layout, stack_rules
from tfjax.interop.core.registry import Converts, Row
from tfjax.interop.core.rules import (
    QKV,
    Rule,
    export_state,
    finish,
    identity,
    import_state,
    linear,
    norm,
    param_shapes,
    torch_mha,
    unrolled,
)
from tfjax.interop.core.tables import TOKENS
from tfjax.models import transformer
from tfjax.nn import AttentionConfig, MultiHeadAttention
from tfjax.ops import ACTIVATIONS

__all__ = ["from_torch_mha", "from_torch_transformer", "to_torch_mha", "to_torch_transformer"]

TORCH = "torch.nn.Transformer"
MHA = "torch.nn.MultiheadAttention"
TORCH_LAYOUT = Layout(
    fused_qkv=True,
    cross_attn="multihead_attn",
    fc1="linear1",
    fc2="linear2",
    encoder_norms=("norm1", "norm2"),
    decoder_norms=("norm1", "norm2", "norm3"),
)


# Fields whose value a caller may choose over the module's: they change training, not outputs.
DROPOUT_FIELDS = ("dropout_rate", "attention_dropout_rate", "mlp_dropout_rate")


def _final_norms(model) -> bool:
    """Whether the model's stacks end in a norm (pre-LN stacks always do)."""
    return model.final_norm or model.norm_position == "pre"


def _check_model(model, what: str):
    if not isinstance(model, transformer.Transformer):
        raise ValueError(f"{what}: expected a tfjax.models.transformer model, got {type(model)}")
    have = {k: getattr(model, k) for k in PAPER_LAYOUT}
    if have != PAPER_LAYOUT:
        raise ValueError(f"{what} is the paper's layout: it needs {PAPER_LAYOUT}; got {have}")
    if model.norm_position not in ("post", "pre"):
        raise ValueError(
            f"{what} places its norms after (norm_first=False) or before (norm_first=True) "
            f"each sub-layer; the model has norm_position={model.norm_position!r}"
        )


def _count_layers(state, prefix: str) -> int:
    ids = {k[len(prefix) :].split(".", 1)[0] for k in state if k.startswith(prefix)}
    return len({int(i) for i in ids if i.isdigit()})


def _torch_state(source) -> files.StateDict:
    if isinstance(source, dict):
        return files.as_state_dict(source)
    if hasattr(source, "state_dict"):
        return files.as_state_dict(source.state_dict(), origin=type(source).__name__)
    return files.read_state_dict(source)


# ----------------------------------------------------------------------------------------------
# What a torch module's attributes decide (its state dict does not hold them).


def _own(module, cls, where: str, what: str):
    """Refuses anything but torch's own `cls` (a subclass that keeps its forward is fine): the
    converter knows the maths of torch's modules only."""
    if isinstance(module, cls) and type(module).forward is cls.forward:
        return
    kind = "a subclass with its own forward" if isinstance(module, cls) else "not one"
    raise ValueError(
        f"{what}: {where} is a {type(module).__name__}, {kind} of torch.nn.{cls.__name__}; the "
        "converter reads torch's own modules only, whose maths it knows"
    )


def _activation(fn, where: str) -> str:
    """The tfjax name of a torch layer's activation (a name or a callable), else a refusal."""
    import torch  # noqa: PLC0415 (torch is optional; a module or a name from it is here)

    functional, nn = torch.nn.functional, torch.nn
    if isinstance(fn, str):
        if fn in ACTIVATIONS:  # torch's "relu" and "gelu" and tfjax's other names
            return fn
    elif fn in (functional.relu, torch.relu) or type(fn) is nn.ReLU:
        return "relu"
    elif fn is functional.gelu or (type(fn) is nn.GELU and fn.approximate == "none"):
        return "gelu"
    elif type(fn) is nn.GELU and fn.approximate == "tanh":
        return "gelu_tanh"
    elif fn is functional.silu or type(fn) is nn.SiLU:
        return "silu"
    raise ValueError(
        f"{TORCH}: {where} is {fn!r}, which tfjax's transformer cannot compute; it takes relu "
        "(F.relu, nn.ReLU), gelu (F.gelu, nn.GELU()), gelu_tanh (nn.GELU(approximate='tanh')) "
        "or silu (F.silu, nn.SiLU)"
    )


def _check_mha(mha, where: str, what: str):
    """What neither converter can honour in a torch.nn.MultiheadAttention, by name."""
    import torch  # noqa: PLC0415

    _own(mha, torch.nn.MultiheadAttention, where, what)
    if mha.bias_k is not None:
        raise ValueError(f"{what}: {where} has add_bias_kv=True, which tfjax has no bias_k for")
    if mha.add_zero_attn:
        raise ValueError(f"{what}: {where} has add_zero_attn=True, which tfjax does not compute")
    if mha.kdim != mha.vdim:
        raise ValueError(
            f"{what}: {where} has kdim={mha.kdim} != vdim={mha.vdim}; tfjax's cross-attention "
            "takes one context for keys and values"
        )


class _Attributes:
    """The value of each torch attribute across a module's layers and the first module with it:
    a model has one value of each, so modules that differ are refused by name."""

    def __init__(self):
        self._seen: dict[str, dict] = {}

    def add(self, name: str, value, where: str):
        self._seen.setdefault(name, {}).setdefault(value, where)

    def where(self, name: str) -> str:
        return next(iter(self._seen[name].values()))

    def __getitem__(self, name: str):
        seen = self._seen[name]
        if len(seen) > 1:
            values = ", ".join(f"{where}: {value!r}" for value, where in seen.items())
            raise ValueError(
                f"{TORCH}: its modules differ in {name} ({values}); tfjax's transformer has one "
                f"{name} for every layer"
            )
        return next(iter(seen))


def _read_module(source, prefix: str, embeddings) -> _Attributes:
    """The attributes of `source` that decide its outputs (its nn.Transformer under `prefix`,
    its stacks, layers, attentions, norms and `embeddings`' modules), each read or refused by
    name."""
    import torch  # noqa: PLC0415

    nn, what = torch.nn, TORCH
    name = prefix.rstrip(".")
    try:
        core = source.get_submodule(name) if name else source
    except AttributeError:
        raise ValueError(
            f"{what}: {type(source).__name__} has no submodule {name!r}; the converter reads a "
            "module holding a torch.nn.Transformer (under prefix=, its path and a '.') and its "
            "token embeddings (embed=, target_embed=, output=)"
        ) from None
    _own(core, nn.Transformer, name or type(source).__name__, what)
    seen = _Attributes()
    seen.add("batch_first", core.batch_first, name)

    def no_bias(where):
        return ValueError(
            f"{what}: {where} has no bias (bias=False); tfjax's transformer has biases in its "
            "LayerNorms, attentions and FFNs"
        )

    def layer_norm(module, where):
        _own(module, nn.LayerNorm, where, what)
        if not module.elementwise_affine:
            raise ValueError(
                f"{what}: {where} has elementwise_affine=False; tfjax's LayerNorm has a scale "
                "and a bias"
            )
        if module.bias is None:
            raise no_bias(where)
        seen.add("layer_norm_eps", module.eps, where)

    def dropout(module, where):
        if type(module) is nn.Identity:
            return 0.0
        _own(module, nn.Dropout, where, what)
        return module.p

    stacks = (
        ("encoder", nn.TransformerEncoder, nn.TransformerEncoderLayer, ("self_attn",)),
        (
            "decoder",
            nn.TransformerDecoder,
            nn.TransformerDecoderLayer,
            ("self_attn", "multihead_attn"),
        ),
    )
    for side, stack_cls, layer_cls, attentions in stacks:
        path = f"{prefix}{side}"
        stack = getattr(core, side)
        _own(stack, stack_cls, path, what)
        if stack.norm is not None:
            layer_norm(stack.norm, f"{path}.norm")
        for i, layer in enumerate(stack.layers):
            at = f"{path}.layers.{i}"
            _own(layer, layer_cls, at, what)
            seen.add("norm_first", bool(layer.norm_first), at)
            seen.add("activation", _activation(layer.activation, f"{at}.activation"), at)
            for attention in attentions:
                where, mha = f"{at}.{attention}", getattr(layer, attention)
                _check_mha(mha, where, what)
                if not mha._qkv_same_embed_dim:  # noqa: SLF001 (torch's own kdim/vdim flag)
                    raise ValueError(
                        f"{what}: {where} has kdim={mha.kdim}, vdim={mha.vdim} for embed_dim="
                        f"{mha.embed_dim}; a layer's attention reads the model width"
                    )
                if mha.in_proj_bias is None:
                    raise no_bias(where)
                seen.add("nhead", mha.num_heads, where)
                seen.add("batch_first", mha.batch_first, where)
                seen.add("attention dropout", mha.dropout, where)
            for fc in ("linear1", "linear2"):
                _own(getattr(layer, fc), nn.Linear, f"{at}.{fc}", what)
                if getattr(layer, fc).bias is None:
                    raise no_bias(f"{at}.{fc}")
            for norm_name in ("norm1", "norm2", "norm3")[: len(attentions) + 1]:
                layer_norm(getattr(layer, norm_name), f"{at}.{norm_name}")
            seen.add("FFN dropout", dropout(layer.dropout, f"{at}.dropout"), at)
            for residual in ("dropout1", "dropout2", "dropout3")[: len(attentions) + 1]:
                seen.add("dropout", dropout(getattr(layer, residual), f"{at}.{residual}"), at)
    for key in embeddings:
        try:
            module = source.get_submodule(key.rsplit(".", 1)[0])
        except AttributeError:
            continue  # no such module (a key the weights may still hold)
        if isinstance(module, nn.Embedding) and module.max_norm is not None:
            raise ValueError(
                f"{what}: {key.rsplit('.', 1)[0]} has max_norm={module.max_norm}, which rescales "
                "its rows as they are looked up; tfjax's embedding does not"
            )
    seen["batch_first"]  # raises unless every layer takes the layout its wrapper feeds
    return seen


# The tfjax field each torch attribute decides, and the explicit argument that can name it.
_DECIDED = (  # (field, attribute, argument)
    ("num_heads", "nhead", "num_heads"),
    ("activation", "activation", "activation"),
    ("norm_eps", "layer_norm_eps", "norm_eps"),
    ("norm_position", "norm_first", "norm_first"),
)
_DROPOUTS = (  # (field, attribute): the module's values unless the caller sets the field
    ("dropout_rate", "dropout"),
    ("attention_dropout_rate", "attention dropout"),
    ("mlp_dropout_rate", "FFN dropout"),
)


def _position(norm_first) -> str:
    return "pre" if norm_first else "post"


def torch_transformer_rules(
    model: transformer.Transformer,
    *,
    prefix: str = "transformer.",
    embed: str = "embed.weight",
    target_embed: str = "target_embed.weight",
    output: str = "output.weight",
) -> list[Rule]:
    rules = [identity(embed, ("embed", "embedding"))]
    if not model.share_embeddings:
        rules += [
            identity(target_embed, ("target_embed", "embedding")),
            linear(output, ("output_proj", "kernel")),
        ]
    rules += stack_rules(model.num_layers, TORCH_LAYOUT, prefix)
    if _final_norms(model):
        for side in ("encoder", "decoder"):
            rules += norm(f"{prefix}{side}.norm", (side, "final_norm"))
    return rules


def _decided_by_arguments(state, num_heads, activation, norm_eps, norm_first):
    """The fields a module would decide, from the arguments (weights alone do not hold them)."""
    if num_heads is None:
        raise ValueError(
            f"{TORCH}: weights alone ({state.origin}) do not hold the number of heads: pass "
            "num_heads= (nn.Transformer's nhead)"
        )
    return dict(
        num_heads=num_heads,
        activation=activation or "relu",
        norm_eps=1e-5 if norm_eps is None else norm_eps,
        norm_position=_position(norm_first),
    )


def _decided_by_module(seen: _Attributes, given: dict, overrides: dict) -> dict:
    """The fields the module's attributes decide; an argument naming one must agree with it,
    and its dropout rates are the model's unless `overrides` set them."""
    decided = {}
    for field, attribute, argument in _DECIDED:
        value = seen[attribute]
        if given[argument] is not None and given[argument] != value:
            raise ValueError(
                f"{TORCH}: {argument}={given[argument]!r}, but {seen.where(attribute)} has "
                f"{attribute}={value!r}; leave {argument} out: the module decides it"
            )
        decided[field] = _position(value) if attribute == "norm_first" else value
    for field, attribute in _DROPOUTS:
        if field not in overrides:
            decided[field] = seen[attribute]
    return decided


def _stack_sizes(state, prefix: str, embed: str, decided: dict) -> dict:
    """vocab_size, width, num_layers and final_norm from the weights, checked against each other
    and against the decided heads and norm placement."""
    if embed not in state:
        raise ValueError(
            f"{TORCH}: no token embedding {embed!r} in {state.origin} (it holds {len(state)} "
            f"keys such as {files.listing(state, 4)}); pass embed= the key of the [V, D] embedding"
        )
    vocab, width = state.shape(embed)
    layers = _count_layers(state, f"{prefix}encoder.layers.")
    if not layers:
        raise ValueError(
            f"{TORCH}: no keys under {prefix}encoder.layers. in {state.origin}; is it a "
            f"torch.nn.Transformer state dict (prefix={prefix!r})?"
        )
    decoder_layers = _count_layers(state, f"{prefix}decoder.layers.")
    if decoder_layers != layers:
        raise ValueError(
            f"{TORCH}: {state.origin} has {layers} encoder and {decoder_layers} decoder layers; "
            "tfjax's transformer has one num_layers for both"
        )
    # nn.Transformer's default: a LayerNorm after each stack (norm=None in custom stacks: none).
    final_norms = [f"{prefix}{side}.norm.weight" in state for side in ("encoder", "decoder")]
    if final_norms[0] != final_norms[1]:
        raise ValueError(
            f"{TORCH}: {state.origin} has a final norm after only one of the stacks "
            f"({prefix}encoder.norm: {final_norms[0]}, {prefix}decoder.norm: {final_norms[1]}); "
            "tfjax's transformer has both or neither"
        )
    if decided["norm_position"] == "pre" and not final_norms[0]:
        raise ValueError(
            f"{TORCH}: norm_first=True stacks without final norms (no {prefix}encoder.norm or "
            f"{prefix}decoder.norm in {state.origin}); tfjax's pre-LN stacks end in a LayerNorm, "
            "so it takes them with their final norms only (nn.Transformer's own stacks have them)"
        )
    if width % decided["num_heads"]:
        raise ValueError(
            f"{TORCH}: num_heads={decided['num_heads']} does not divide the width {width} of "
            f"{embed!r} in {state.where(embed)}"
        )
    return dict(vocab_size=vocab, width=width, num_layers=layers, final_norm=final_norms[0])


def _tied_output(state, embed: str, target_embed: str, output: str):
    """(share_embeddings, the `tied` keys of import_state): without a target embedding the
    embeddings are shared, and an `output` there must be the embedding itself."""
    share = target_embed not in state
    if not (share and output in state):
        return share, None
    if not np.array_equal(state[output], state[embed]):
        raise ValueError(
            f"{TORCH}: {output!r} in {state.where(output)} differs from {embed!r}; an output "
            "projection of its own needs a separate target embedding (target_embed=)"
        )
    return share, {output: embed}


def _mlp_dim(state, prefix: str) -> int:
    mlp_key = f"{prefix}encoder.layers.0.linear1.weight"
    if mlp_key not in state:
        raise ValueError(
            f"{TORCH}: {mlp_key!r} is missing from {state.origin}; a torch.nn.Transformer's "
            "layers each hold linear1 and linear2 (the FFN)"
        )
    return state.shape(mlp_key)[0]


def _check_overrides(fields: dict, overrides: dict, decided: dict, decider: str) -> None:
    """Overrides may set only what leaves the outputs as the weights and `decider` give them."""
    for field, value in overrides.items():
        if field in fields and field not in DROPOUT_FIELDS and value != fields[field]:
            where = "the weights" if field not in decided else decider
            raise ValueError(
                f"{TORCH}: {field}={value!r} would change the outputs: {where} give "
                f"{field}={fields[field]!r}; overrides set only what leaves them unchanged "
                "(scan_layers, dtype, implementation, dropout rates, ...)"
            )


def from_torch_transformer(
    source,
    *,
    num_heads: int | None = None,
    activation=None,
    norm_eps: float | None = None,
    norm_first: bool | None = None,
    prefix: str = "transformer.",
    embed: str = "embed.weight",
    target_embed: str = "target_embed.weight",
    output: str = "output.weight",
    ignore=(),
    **overrides,
):
    """(tfjax transformer, params) from a module holding a `torch.nn.Transformer` and its
    embeddings, its state dict, or a directory with its weights.

    The nn.Transformer's keys are under `prefix`; `embed` is the [V, D] token embedding (the
    source's, and the target's and the output projection's when `target_embed` is absent);
    with `target_embed` present, `output` is the nn.Linear(D, V, bias=False) output projection.
    A tied `output` equal to `embed` is accepted. Sizes come from the weights. A module's
    attributes give the heads, activation, norm eps and placement and the dropout rates (see
    the module docstring); `num_heads`, `activation` (a name or torch's callable), `norm_eps`
    and `norm_first` are for weights without a module, which do not hold them (defaults:
    nn.Transformer's relu, 1e-5, post-LN); given with a module they must agree with it.
    Positions are the paper's interleaved sinusoids added to embeddings scaled by sqrt(D).
    `ignore`: fnmatch patterns of keys that hold no parameters (buffers). `overrides`: fields
    that leave the outputs as they are (scan_layers, dtype, implementation, dropout rates).
    """
    if activation is not None:
        activation = _activation(activation, f"activation={activation!r}")
    given = dict(
        num_heads=num_heads, activation=activation, norm_eps=norm_eps, norm_first=norm_first
    )
    state = _torch_state(source)
    if isinstance(source, dict) or not hasattr(source, "state_dict"):  # weights alone
        decided = _decided_by_arguments(state, **given)
        decider = "the arguments (num_heads=, activation=, norm_eps=, norm_first=)"
    else:
        seen = _read_module(source, prefix, (embed, target_embed))
        decided = _decided_by_module(seen, given, overrides)
        decider = f"the module's attributes ({type(source).__name__})"
    sizes = _stack_sizes(state, prefix, embed, decided)
    share, tied = _tied_output(state, embed, target_embed, output)
    fields = dict(**sizes, mlp_dim=_mlp_dim(state, prefix), share_embeddings=share, **decided)
    _check_overrides(fields, overrides, decided, decider)
    model = transformer.Model(**{**fields, **overrides})
    names = dict(prefix=prefix, embed=embed, target_embed=target_embed, output=output)
    params = import_state(
        state,
        torch_transformer_rules(model, **names),
        param_shapes(model, TOKENS, TOKENS),
        what=TORCH,
        ignore=ignore,
        tied=tied,
    )
    return model, finish(model, params)


def to_torch_transformer(
    model: transformer.Transformer,
    params,
    *,
    prefix: str = "transformer.",
    embed: str = "embed.weight",
    target_embed: str = "target_embed.weight",
    output: str = "output.weight",
) -> dict:
    """{torch key: numpy array} for a module like the one `from_torch_transformer` reads (the
    output projection is left out when embeddings are shared). The module is built with the
    model's activation, norm_eps and norm_first=(norm_position == "pre"): weights do not hold
    them."""
    _check_model(model, TORCH)
    if model.logits_bias:
        raise ValueError(f"{TORCH}'s output projection has no bias; the model has logits_bias")
    names = dict(prefix=prefix, embed=embed, target_embed=target_embed, output=output)
    return export_state(unrolled(model, params), torch_transformer_rules(model, **names))


# ----------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention.


_MODULE_FIELDS = ("kernel_init", "dtype", "param_dtype")


def mha_module(num_heads: int, use_bias: bool, **overrides) -> MultiHeadAttention:
    """The tfjax attention module of a torch.nn.MultiheadAttention (the one place interop builds
    one). `overrides` are the module's fields (dtype, param_dtype, kernel_init) or its
    AttentionConfig's (implementation, dropout_rate, ...)."""
    module = {k: overrides.pop(k) for k in _MODULE_FIELDS if k in overrides}
    config = AttentionConfig(num_heads=num_heads, use_bias=use_bias, **overrides)
    return MultiHeadAttention(config, **module)


def mha_rules(separate: bool, use_bias: bool) -> list[Rule]:
    rules = torch_mha((), "", bias=use_bias)
    if separate:  # kdim = vdim != embed_dim: q_proj_weight, k_proj_weight, v_proj_weight
        names = zip("qkv", QKV, strict=True)
        rules[:1] = [linear(f"{t}_proj_weight", (f"{n}_kernel",)) for t, n in names]
    return rules


def from_torch_mha(source, num_heads: int | None = None, **overrides):
    """(tfjax MultiHeadAttention, params) from a torch.nn.MultiheadAttention or its state dict.

    A module gives its heads and its dropout rate; `num_heads` is required for a state dict
    (given with a module it must agree). `overrides` set module fields (dtype, implementation,
    dropout_rate, ...). tfjax's inputs are [B, T, D] whatever the module's batch_first.
    """
    what = MHA
    if isinstance(source, dict):
        state = files.as_state_dict(source)
        if num_heads is None:
            raise ValueError(
                f"{what}: a state dict does not hold the number of heads: pass num_heads="
            )
    else:
        _check_mha(source, type(source).__name__, what)
        if num_heads is not None and num_heads != source.num_heads:
            raise ValueError(
                f"{what}: num_heads={num_heads}, but the module has num_heads="
                f"{source.num_heads}; leave num_heads out: the module decides it"
            )
        num_heads = source.num_heads
        overrides = {"dropout_rate": source.dropout, **overrides}
        state = files.as_state_dict(source.state_dict(), origin=what)
    for key in ("bias_k", "bias_v"):
        if key in state:
            raise ValueError(f"{what}: {key!r} (add_bias_kv) has no tfjax counterpart")
    separate = "in_proj_weight" not in state and "q_proj_weight" in state
    projections = [f"{t}_proj_weight" for t in "qkv"] if separate else ["in_proj_weight"]
    missing = [k for k in (*projections, "out_proj.weight") if k not in state]
    if missing:
        raise ValueError(
            f"{what}: {files.listing(missing)} missing from {state.origin}, which holds "
            f"{files.listing(state, 6) or 'no keys'}; expected in_proj_weight [3D, D] (or "
            "q_proj_weight, k_proj_weight, v_proj_weight when kdim = vdim != embed_dim), "
            "out_proj.weight [D, D], and with bias=True in_proj_bias and out_proj.bias"
        )
    for key in projections:
        if len(state.shape(key)) != 2:
            raise ValueError(
                f"{what}: {key!r} in {state.where(key)} has shape {state.shape(key)}; expected "
                "a matrix [out, in]"
            )
    use_bias = "in_proj_bias" in state or "out_proj.bias" in state
    width = state.shape(projections[0])[1]
    context_width = state.shape("k_proj_weight")[1] if separate else width
    if separate and state.shape("v_proj_weight")[1] != context_width:
        raise ValueError(f"{what}: k_proj_weight and v_proj_weight differ in input width")
    if width % num_heads:
        raise ValueError(f"{what}: num_heads={num_heads} does not divide embed_dim={width}")
    model = mha_module(num_heads, use_bias, **overrides)
    x = jnp.zeros((1, 1, width), jnp.float32)
    context = jnp.zeros((1, 1, context_width), jnp.float32) if separate else None
    params = import_state(
        state,
        mha_rules(separate, use_bias),
        param_shapes(model, x, context),
        what=what,
    )
    return model, finish(model, params)


def to_torch_mha(model: MultiHeadAttention, params) -> dict:
    """{torch key: numpy array}, loadable with `torch_mha.load_state_dict` (after
    torch.from_numpy); the separate q/k/v layout when key and query widths differ."""
    p = unrolled(model, params)
    separate = p["query_kernel"].shape[0] != p["key_kernel"].shape[0]
    return export_state(p, mha_rules(separate, model.config.use_bias))


# Neither is a Hugging Face architecture: `interop.load` and `interop.save` have none of them.
CONVERTS = Converts(  # torch modules and state dicts: no config.json, nothing `interop.load` reads
    rows=(
        Row(
            "`torch.nn.Transformer` with embeddings",
            "`from_torch_transformer` / `to_torch_transformer`",
            "transformer",
            "(post- or pre-LN by `norm_first`; relu, gelu, silu; heads, norm eps and dropout rates "
            "read from the module, whatever changes the outputs and has no tfjax counterpart "
            "refused by name)",
        ),
        Row(
            "`torch.nn.MultiheadAttention`",
            "`from_torch_mha` / `to_torch_mha`",
            "tfjax.nn.MultiHeadAttention",
            "(heads and dropout from the module; `add_bias_kv`, `add_zero_attn`, `kdim` != `vdim` "
            "refused)",
        ),
    ),
)
