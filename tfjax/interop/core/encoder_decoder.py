"""What Marian and torch.nn.Transformer share: the paper's encoder-decoder layout, their
layers' keys told apart by a `Layout` of names.

Both are post-LN stacks with sinusoidal positions added to token embeddings scaled by
sqrt(d_model) and a one-projection FFN (`PAPER_LAYOUT`: the tfjax.models.transformer fields T5
sets otherwise). Key mapping, layer i of each stack (under "{prefix}{en,de}coder.layers."):
  self-attention (Marian: self_attn.{q,k,v,out}_proj; torch: self_attn.in_proj_weight [3D, D],
      rows q, k, v, and out_proj)  -> {en,de}coder/layers_i/self_attention/*
  cross-attention (Marian: encoder_attn; torch: multihead_attn) -> decoder/layers_i/
      cross_attention/*
  the norms after each sub-layer  -> self_attention_norm, (cross_attention_norm,) mlp_norm
  the FFN (Marian: fc1, fc2; torch: linear1, linear2) -> mlp/wi, mlp/wo
"""

import dataclasses

from tfjax.interop.core.rules import Rule, attention, mlp, norm, torch_mha

# The paper's layout, which both references have: fields T5 (`transformer.T5`) sets otherwise.
PAPER_LAYOUT = {
    "position": "sinusoidal",
    "norm": "layer",
    "use_bias": True,
    "scale_embeddings": True,
    "attention_scale": None,
    "head_dim": None,
    "tie_embeddings": None,
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """The key names of one family's layers (after "{prefix}{en,de}coder.layers.{i}.")."""

    fused_qkv: bool  # torch.nn.MultiheadAttention's in_proj_weight vs q_proj / k_proj / v_proj
    cross_attn: str  # the decoder's cross-attention (self-attention is self_attn in both)
    fc1: str
    fc2: str
    encoder_norms: tuple[str, str]  # after self-attention, after the FFN
    decoder_norms: tuple[str, str, str]  # after self-attention, cross-attention, the FFN


def _attention(key: str, path, fused: bool) -> list[Rule]:
    return torch_mha(path, f"{key}.") if fused else attention(path, f"{key}.")


def stack_rules(num_layers: int, layout: Layout, prefix: str) -> list[Rule]:
    """The rules of both stacks' layers (keys under {prefix}encoder. and {prefix}decoder.)."""
    rules = []
    for side in ("encoder", "decoder"):
        for i in range(num_layers):
            k, layer = f"{prefix}{side}.layers.{i}.", (side, f"layers_{i}")
            norms = layout.encoder_norms if side == "encoder" else layout.decoder_norms
            rules += _attention(f"{k}self_attn", (*layer, "self_attention"), layout.fused_qkv)
            rules += norm(k + norms[0], (*layer, "self_attention_norm"))
            if side == "decoder":
                cross = (*layer, "cross_attention")
                rules += _attention(k + layout.cross_attn, cross, layout.fused_qkv)
                rules += norm(k + norms[1], (*layer, "cross_attention_norm"))
            rules += mlp((*layer, "mlp"), k + layout.fc1, k + layout.fc2)
            rules += norm(k + norms[-1], (*layer, "mlp_norm"))
    return rules
