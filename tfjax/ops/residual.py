"""A Transformer block's residual sub-layer, wired by the norm's position (the block's parts are
the module system's: the sub-layer, its norms, layer scale and dropout come in as callables).

  "post": x = LN(x + Dropout(F(x)))      Vaswani et al. (2017), BERT
  "pre":  x = x + Dropout(F(LN(x)))      GPT-2, ViT, Llama (the stack adds a final norm)
  "sandwich": x = x + Dropout(LN'(F(LN(x))))  Gemma 2 / 3: a norm before and after (as "pre")
"""


def sublayer(x, f, *, norm_position: str, norm, post_norm=None, scale=None, dropout=None):
    """x [B, T, D] -> [B, T, D]: the residual sub-layer of f with its norm per `norm_position`.

    norm, post_norm (sandwich), scale (a layer scale) and dropout are callables [B, T, D] ->
    [B, T, D], called only where the position uses them (a module system may create their
    parameters on that call); scale and dropout: the identity when None.
    """
    scale = scale or (lambda y: y)
    dropout = dropout or (lambda y: y)
    if norm_position in ("pre", "sandwich"):
        y = f(norm(x))
        if norm_position == "sandwich":
            y = post_norm(y)
        return x + dropout(scale(y))
    return norm(x + dropout(scale(f(x))))
