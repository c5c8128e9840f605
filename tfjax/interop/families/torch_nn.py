"""Plain PyTorch modules <-> tfjax: `torch.nn.Transformer` with embeddings <->
`tfjax.models.transformer`, and `torch.nn.MultiheadAttention` <-> `tfjax.nn.MultiHeadAttention`.

    model, params = from_torch_transformer(module, num_heads=8)   # or a state dict / directory
    logits, _ = model.apply({"params": params}, inputs, targets)  # [B, S], [B, T] -> [B, T, V]
    state = to_torch_transformer(model, params)
    mha, params = from_torch_mha(torch_module)               # or (state_dict, num_heads=...)
    y = mha.apply({"params": params}, x)                     # self-attention, x [B, T, D]
    y = mha.apply({"params": params}, x, context, mask=m)    # cross-attention, one context

torch.nn.Transformer is the paper's layout (`core.encoder_decoder`): post-LN blocks,
sinusoidal positions added to token embeddings scaled by sqrt(d_model), a FFN with one
activation (ReLU in the paper); its own stacks end in a LayerNorm each (`final_norm=True`).
Positions are the paper's interleaved sinusoids (as PyTorch's tutorial), tfjax's own.

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
from tfjax.interop.core.registry import Converts
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

TORCH = "torch.nn.Transformer"
TORCH_LAYOUT = Layout(
    fused_qkv=True,
    cross_attn="multihead_attn",
    fc1="linear1",
    fc2="linear2",
    encoder_norms=("norm1", "norm2"),
    decoder_norms=("norm1", "norm2", "norm3"),
)


def _check_model(model, what: str):
    if not isinstance(model, transformer.Transformer):
        raise ValueError(f"{what}: expected a tfjax.models.transformer model, got {type(model)}")
    have = {k: getattr(model, k) for k in PAPER_LAYOUT}
    if have != PAPER_LAYOUT:
        raise ValueError(f"{what} is the paper's layout: it needs {PAPER_LAYOUT}; got {have}")
    if model.norm_position != "post":
        raise ValueError(
            f"{what} is post-LN; the model has norm_position={model.norm_position!r} (its "
            "pre-LN stacks end in a final norm the reference has no key for)"
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
    if model.final_norm:
        for side in ("encoder", "decoder"):
            rules += norm(f"{prefix}{side}.norm", (side, "final_norm"))
    return rules


def from_torch_transformer(
    source,
    *,
    num_heads: int,
    prefix: str = "transformer.",
    embed: str = "embed.weight",
    target_embed: str = "target_embed.weight",
    output: str = "output.weight",
    activation: str = "relu",
    norm_eps: float = 1e-5,
    ignore=(),
    **overrides,
):
    """(tfjax transformer, params) from a module holding a post-LN `torch.nn.Transformer` and
    its embeddings, its state dict, or a directory with its weights.

    The nn.Transformer's keys are under `prefix`; `embed` is the [V, D] token embedding (the
    source's, and the target's and the output projection's when `target_embed` is absent);
    with `target_embed` present, `output` is the nn.Linear(D, V, bias=False) output projection.
    A tied `output` equal to `embed` is accepted. Sizes come from the weights; `num_heads`,
    `activation` and `norm_eps` (nn.Transformer's defaults: relu, 1e-5) are not stored in a
    state dict. Positions are the paper's interleaved sinusoids added to embeddings scaled by
    sqrt(D). `ignore`: fnmatch patterns of keys that hold no parameters (buffers).
    """
    what = TORCH
    state = _torch_state(source)
    if embed not in state:
        raise ValueError(
            f"{what}: no token embedding {embed!r} in {state.origin} (it holds {len(state)} keys "
            f"such as {files.listing(state, 4)}); pass embed= the key of the [V, D] embedding"
        )
    vocab, width = state[embed].shape
    layers = _count_layers(state, f"{prefix}encoder.layers.")
    if not layers:
        raise ValueError(
            f"{what}: no keys under {prefix}encoder.layers. in {state.origin}; is it a "
            f"torch.nn.Transformer state dict (prefix={prefix!r})?"
        )
    decoder_layers = _count_layers(state, f"{prefix}decoder.layers.")
    if decoder_layers != layers:
        raise ValueError(
            f"{what}: {state.origin} has {layers} encoder and {decoder_layers} decoder layers; "
            "tfjax's transformer has one num_layers for both"
        )
    # nn.Transformer's default: a LayerNorm after each stack (norm=None in custom stacks: none).
    final_norms = [f"{prefix}{side}.norm.weight" in state for side in ("encoder", "decoder")]
    if final_norms[0] != final_norms[1]:
        raise ValueError(
            f"{what}: {state.origin} has a final norm after only one of the stacks "
            f"({prefix}encoder.norm: {final_norms[0]}, {prefix}decoder.norm: {final_norms[1]}); "
            "tfjax's transformer has both or neither"
        )
    if width % num_heads:
        raise ValueError(
            f"{what}: num_heads={num_heads} does not divide the width {width} of {embed!r} in "
            f"{state.where(embed)}"
        )
    share = target_embed not in state
    tied = None
    if share and output in state:
        if not np.array_equal(state[output], state[embed]):
            raise ValueError(
                f"{what}: {output!r} in {state.where(output)} differs from {embed!r}; an output "
                "projection of its own needs a separate target embedding (target_embed=)"
            )
        tied = {output: embed}
    mlp_key = f"{prefix}encoder.layers.0.linear1.weight"
    if mlp_key not in state:
        raise ValueError(f"{what}: {mlp_key!r} is missing from {state.origin}")
    fields = dict(
        vocab_size=vocab,
        width=width,
        num_layers=layers,
        num_heads=num_heads,
        mlp_dim=state[mlp_key].shape[0],
        activation=activation,
        norm_position="post",
        norm_eps=norm_eps,
        share_embeddings=share,
        final_norm=final_norms[0],
    )
    model = transformer.Model(**{**fields, **overrides})
    names = dict(prefix=prefix, embed=embed, target_embed=target_embed, output=output)
    params = import_state(
        state,
        torch_transformer_rules(model, **names),
        param_shapes(model, TOKENS, TOKENS),
        what=what,
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
    output projection is left out when embeddings are shared)."""
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

    `num_heads` is required for a state dict (a module knows it); `overrides` set module fields
    (dtype, implementation, ...).
    """
    what = "torch.nn.MultiheadAttention"
    if isinstance(source, dict):
        state = files.as_state_dict(source)
        if num_heads is None:
            raise ValueError(f"{what}: a state dict needs num_heads")
    else:
        if getattr(source, "bias_k", None) is not None or getattr(source, "add_zero_attn", False):
            raise ValueError(f"{what}: add_bias_kv / add_zero_attn have no tfjax counterpart")
        if source.kdim != source.vdim:
            raise ValueError(
                f"{what}: kdim={source.kdim} != vdim={source.vdim}; tfjax's cross-attention "
                "takes one context for keys and values"
            )
        num_heads = source.num_heads if num_heads is None else num_heads
        state = files.as_state_dict(source.state_dict(), origin=what)
    for key in ("bias_k", "bias_v"):
        if key in state:
            raise ValueError(f"{what}: {key!r} (add_bias_kv) has no tfjax counterpart")
    separate = "in_proj_weight" not in state and "q_proj_weight" in state
    use_bias = "in_proj_bias" in state or "out_proj.bias" in state
    query = state["q_proj_weight" if separate else "in_proj_weight"]
    width = query.shape[1]
    context_width = state["k_proj_weight"].shape[1] if separate else width
    if separate and state["v_proj_weight"].shape[1] != context_width:
        raise ValueError(f"{what}: k_proj_weight and v_proj_weight differ in input width")
    if query.shape[1] % num_heads:
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
CONVERTS = Converts()
