"""Key rules: how PyTorch state-dict keys become tfjax parameter paths, and back.

A `Rule` ties one or more PyTorch keys to one or more tfjax parameter paths, with an exact
function each way (transposes, reshapes, splits), so round trips are bitwise. The constructors
below are the shapes every family's layout is made of (`linear`: torch.nn.Linear [out, in] <->
Dense [in, out] or attention [D, N, H]; `stacked_linear`: a fused q/k/v tensor; `attention`:
the four projections of one attention layer; ...).

`import_state` applies rules to a state dict and checks everything before returning: a missing
key, an unexpected key or a shape that does not match the model built from the config is a
ValueError that names the key and the file it came from, so nothing is ever loaded half-way.
`export_state` runs the same rules backwards.

Parameter trees here are the plain "params" collection (no {"params": ...} wrapper, no logical
boxes), in the unrolled layout (`layers_0`, `layers_1`, ...); `finish` stacks them for models
with `scan_layers=True` and `unrolled` undoes that before export.
"""

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfjax.interop.core.files import StateDict, listing
from tfjax.nn import scanned_to_unrolled, unrolled_to_scanned

Path = tuple[str, ...]
QKV = ("query", "key", "value")  # tfjax's attention projections, in torch's fused row order


@dataclasses.dataclass(frozen=True)
class Rule:
    """keys (PyTorch) <-> paths (tfjax). `to_jax(*arrays, shapes)` -> tuple, `to_torch(*params)`
    -> tuple; both must be exact (transposes, reshapes, splits), so round trips are bitwise."""

    keys: tuple[str, ...]
    paths: tuple[Path, ...]
    to_jax: Callable
    to_torch: Callable


def _one(fn):
    return lambda *xs: (fn(*xs),)


def identity(key, path) -> Rule:
    """Same shape on both sides (norm scales, biases, embeddings, Conv1D kernels [in, out])."""
    return Rule((key,), (path,), lambda x, shapes: (x,), lambda y: (y,))


def linear(key, path) -> Rule:
    """torch.nn.Linear weight [out, in] <-> Dense kernel [in, out] or attention [D, N, H]."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.T.reshape(shapes[0]),),
        _one(lambda y: y.reshape(y.shape[0], -1).T),
    )


def linear_out(key, path) -> Rule:
    """torch.nn.Linear weight [D, N*H] <-> attention out_kernel [N, H, D]."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.T.reshape(shapes[0]),),
        _one(lambda y: y.reshape(-1, y.shape[-1]).T),
    )


def reshaped(key, path) -> Rule:
    """A flat bias [N*H] <-> [N, H] (or any shape with the same elements, flattened back)."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.reshape(shapes[0]),),
        _one(lambda y: y.reshape(-1)),
    )


def rows_out(key, path) -> Rule:
    """GPT-2's Conv1D weight [N*H, D] (already [in, out]) <-> attention out_kernel [N, H, D]."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.reshape(shapes[0]),),
        _one(lambda y: y.reshape(-1, y.shape[-1])),
    )


def merged_rows(key, paths) -> Rule:
    """One [in, N*H]-like tensor split into len(paths) params along its last axis (GPT-2's
    fused c_attn: [D, 3D] -> query/key/value [D, N, H]; bias [3D] -> [N, H] each)."""

    def to_jax(x, shapes):
        parts = np.split(x, len(paths), axis=-1)
        return tuple(p.reshape(s) for p, s in zip(parts, shapes, strict=True))

    def to_torch(*ys):
        flat = [y.reshape(-1) if y.ndim == 2 else y.reshape(y.shape[0], -1) for y in ys]
        return (jnp.concatenate(flat, axis=-1),)

    return Rule((key,), tuple(paths), to_jax, to_torch)


def stacked_linear(key, paths) -> Rule:
    """torch MHA's in_proj_weight [3 D, D] (rows q, k, v) <-> three [D, N, H] kernels; for a
    1-D in_proj_bias [3 D] <-> three [N, H] biases."""

    def to_jax(x, shapes):
        parts = np.split(x, len(paths), axis=0)
        if x.ndim == 1:
            return tuple(p.reshape(s) for p, s in zip(parts, shapes, strict=True))
        return tuple(p.T.reshape(s) for p, s in zip(parts, shapes, strict=True))

    def to_torch(*ys):
        if ys[0].ndim == 2:
            return (jnp.concatenate([y.reshape(-1) for y in ys]),)
        return (jnp.concatenate([y.reshape(y.shape[0], -1).T for y in ys], axis=0),)

    return Rule((key,), tuple(paths), to_jax, to_torch)


def conv(key, path) -> Rule:
    """torch Conv2d weight [out, in, kh, kw] <-> Flax Conv kernel [kh, kw, in, out]."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.transpose(2, 3, 1, 0),),
        _one(lambda y: y.transpose(3, 2, 0, 1)),
    )


def norm(key, path) -> list[Rule]:
    """A LayerNorm's weight and bias <-> a Flax LayerNorm's scale and bias."""
    return [identity(f"{key}.weight", (*path, "scale")), identity(f"{key}.bias", (*path, "bias"))]


def dense(key, path) -> list[Rule]:
    """A torch.nn.Linear with bias <-> a Flax Dense."""
    return [linear(f"{key}.weight", (*path, "kernel")), identity(f"{key}.bias", (*path, "bias"))]


def mlp(path, fc1, fc2) -> list[Rule]:
    """A one-projection FFN's two torch.nn.Linear layers (with biases) <-> mlp/wi and mlp/wo."""
    return [*dense(fc1, (*path, "wi")), *dense(fc2, (*path, "wo"))]


def reshaped_as(key, path, torch_shape) -> Rule:
    """A tensor stored as `torch_shape(param)` <-> a param of another shape with the same
    elements (CLIP's class_embedding [D] <-> cls [1, 1, D]; Marian's [1, V] logits bias)."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.reshape(shapes[0]),),
        lambda y: (y.reshape(torch_shape(y)),),
    )


def halves(key, paths) -> Rule:
    """One torch tensor [2F, ...] <-> two params, its first and second half along axis 0 (a
    Linear's weight transposed to [D, F] kernels; a bias [2F] to two [F] biases)."""

    def to_jax(x, shapes):
        parts = np.split(x, 2, axis=0)
        return tuple(p.T if p.ndim == 2 else p for p in parts)

    def to_torch(*ys):
        return (jnp.concatenate([y.T if y.ndim == 2 else y for y in ys], axis=0),)

    return Rule((key,), tuple(paths), to_jax, to_torch)


def per_expert(keys, path) -> Rule:
    """E torch.nn.Linear weights [out, in], one per expert, <-> one stacked kernel [E, in, out]
    (a mixture's experts as the Hub's files hold them: experts.j.w1, ...)."""

    def to_jax(*xs):
        *weights, _ = xs  # the last: the shapes
        return (np.stack([w.T for w in weights]),)

    return Rule(tuple(keys), (path,), to_jax, lambda y: tuple(y[j].T for j in range(y.shape[0])))


def fused_experts(key, path) -> Rule:
    """transformers 5's fused expert weights [E, out, in] <-> the stacked kernel [E, in, out]."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (np.swapaxes(x, 1, 2),),
        _one(lambda y: y.swapaxes(1, 2)),
    )


def rotate_half_rows(x, head: int, rope: int, *, back: bool = False):
    """x [M * head, ...] with the last `rope` rows of each of its M blocks of `head` rows
    permuted: RoPE's interleaved pairs (DeepSeek, Llama 4) -> the even rows, then the odd ones
    (tfjax's rotate-half); `back`: the inverse."""
    order = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    if back:
        order = np.argsort(order)
    rows = np.concatenate([np.arange(head - rope), head - rope + order])
    blocks = x.reshape(-1, head, *x.shape[1:])
    return blocks[:, rows].reshape(x.shape)


def interleaved_rope(key, path, head: int, rope: int) -> Rule:
    """A torch.nn.Linear weight [M * head, in] whose blocks of `head` rows end in `rope` rows of
    interleaved RoPE pairs (a query or key projection) <-> a kernel [in, M, head] or [in, M *
    head] with them in rotate-half order (`rotate_half_rows`): the same attention."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (rotate_half_rows(x, head, rope).T.reshape(shapes[0]),),
        lambda y: (rotate_half_rows(y.reshape(y.shape[0], -1).T, head, rope, back=True),),
    )


def fused_expert_halves(key, paths) -> Rule:
    """transformers 5's gate_up_proj [E, 2F, in] (the gate's F rows, then the up projection's)
    <-> two stacked kernels [E, in, F]."""

    def to_jax(x, shapes):
        return tuple(np.swapaxes(p, 1, 2) for p in np.split(x, 2, axis=1))

    def to_torch(*ys):
        return (jnp.concatenate([y.swapaxes(1, 2) for y in ys], axis=1),)

    return Rule((key,), tuple(paths), to_jax, to_torch)


def interleaved(key, paths) -> Rule:
    """One tensor [..., 2F] whose last axis interleaves two params [..., F], the first at the
    even and the second at the odd positions (GPT-OSS's experts.gate_up_proj [E, D, 2F] and its
    bias [E, 2F]: the gate's columns and the up projection's, alternating) <-> the two."""

    def to_jax(x, shapes):
        return x[..., 0::2], x[..., 1::2]

    def to_torch(first, second):
        # [..., F, 2] -> [..., 2F]
        return (jnp.stack([first, second], axis=-1).reshape(*first.shape[:-1], -1),)

    return Rule((key,), tuple(paths), to_jax, to_torch)


def attention(
    path,
    prefix: str,
    names=("q_proj", "k_proj", "v_proj", "out_proj"),
    *,
    qkv_bias: bool = True,
    out_bias: bool = True,
) -> list[Rule]:
    """One attention layer's four torch.nn.Linear projections, keyed `prefix + name`: query,
    key, value [N*H, D] -> {query,key,value}_kernel [D, N, H] (biases [N*H] -> [N, H]) and the
    output [D, N*H] -> out_kernel [N, H, D] (bias [D])."""
    rules = []
    for name, ours in zip(names[:3], QKV, strict=True):
        rules.append(linear(f"{prefix}{name}.weight", (*path, f"{ours}_kernel")))
        if qkv_bias:
            rules.append(reshaped(f"{prefix}{name}.bias", (*path, f"{ours}_bias")))
    rules.append(linear_out(f"{prefix}{names[3]}.weight", (*path, "out_kernel")))
    if out_bias:
        rules.append(identity(f"{prefix}{names[3]}.bias", (*path, "out_bias")))
    return rules


def fused_attention(path, weight: str, bias: str | None, out: str, *, out_bias=True) -> list[Rule]:
    """An attention layer whose query, key and value projections are one tensor (as
    torch.nn.MultiheadAttention's in_proj_weight): `weight` [3 D, D] (rows q, k, v) and `bias`
    [3 D] (None: no biases) -> {query,key,value}_kernel / _bias; the output projection `out`
    (a torch.nn.Linear's key without ".weight") -> out_kernel, out_bias."""
    rules = [stacked_linear(weight, [(*path, f"{n}_kernel") for n in QKV])]
    if bias is not None:
        rules.append(stacked_linear(bias, [(*path, f"{n}_bias") for n in QKV]))
    rules.append(linear_out(f"{out}.weight", (*path, "out_kernel")))
    if out_bias:
        rules.append(identity(f"{out}.bias", (*path, "out_bias")))
    return rules


def torch_mha(path, prefix: str, *, bias: bool = True) -> list[Rule]:
    """torch.nn.MultiheadAttention's keys under `prefix` (in_proj_weight, in_proj_bias,
    out_proj) <-> tfjax's attention params under `path`."""
    in_bias = f"{prefix}in_proj_bias" if bias else None
    out = f"{prefix}out_proj"
    return fused_attention(path, f"{prefix}in_proj_weight", in_bias, out, out_bias=bias)


# ----------------------------------------------------------------------------------------------
# Applying rules to parameter trees.


def flatten(tree, prefix: Path = ()) -> dict[Path, object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def unflatten(flat: dict[Path, object]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return tree


def param_shapes(model: nn.Module, *inputs, **kwargs) -> dict[Path, jax.ShapeDtypeStruct]:
    """Flat path -> ShapeDtypeStruct of `model`'s params, in the unrolled layout (no compute)."""
    if getattr(model, "scan_layers", False):
        model = model.clone(scan_layers=False)
    shapes = jax.eval_shape(lambda *xs: model.init(jax.random.key(0), *xs, **kwargs), *inputs)
    return flatten(nn.unbox(shapes["params"]))


def _fmt(path: Path) -> str:
    return "/".join(path)


def import_state(
    state: StateDict, rules: Sequence[Rule], expected: dict[Path, jax.ShapeDtypeStruct], **checks
) -> dict:
    """Applies `rules` to `state`; returns the unrolled params tree (numpy, expected dtypes).

    `expected` and `checks` (what=, ignore=, tied=) as `check_state` takes them: it checks the
    state first.
    """
    check_state(state, rules, expected, **checks)
    return unflatten(dict(convert_rules(state, rules, expected)))


def check_state(
    state: StateDict,
    rules: Sequence[Rule],
    expected: dict[Path, jax.ShapeDtypeStruct],
    *,
    what: str,
    ignore: Sequence[str] = (),
    tied: dict[str, str] | None = None,
) -> None:
    """`import_state`'s checks, without converting: every key and shape (from `state.shape`,
    which a LazyStateDict reads from the files' headers), the tied keys (read two at a time).

    Args:
      expected: the params of the model built from the config (from `param_shapes`).
      what: the architecture's name, for messages ("GPT2LMHeadModel").
      ignore: fnmatch patterns of keys that hold no parameters (buffers like rotary inv_freq).
      tied: optional key -> key it must equal (an output matrix tied to the embeddings).
    Raises:
      ValueError naming every missing or unexpected key, or the first key whose shape does not
      match, and the file it is in.
    """
    missing = [k for r in rules for k in r.keys if k not in state]
    if missing:
        sample = listing(state)
        raise ValueError(
            f"{what}: {len(missing)} key(s) missing from {state.origin}: {listing(missing)}. "
            f"The checkpoint holds {len(state)} keys such as {sample}; is it a {what} checkpoint "
            "of the configured size?"
        )
    for rule in rules:
        for path in rule.paths:
            if path not in expected:  # a converter bug, not a user error; still say what
                raise ValueError(f"{what}: the model has no parameter {_fmt(path)}")
        want = jax.eval_shape(rule.to_torch, *(expected[p] for p in rule.paths))
        for key, w in zip(rule.keys, want, strict=True):
            if state.shape(key) != tuple(w.shape):
                raise ValueError(
                    f"{what}: {key!r} in {state.where(key)} has shape {state.shape(key)}, but "
                    f"the model built from the config expects {tuple(w.shape)} (for "
                    f"{', '.join(_fmt(p) for p in rule.paths)}); do the config and the weights "
                    "belong together?"
                )
    used = {k for rule in rules for k in rule.keys}
    for key, source in (tied or {}).items():
        if key in state:
            used.add(key)
            if not np.array_equal(state[key], state[source]):
                raise ValueError(
                    f"{what}: {key!r} in {state.where(key)} differs from {source!r}, but the "
                    "model ties them (one matrix); set the config's tie_word_embeddings to False "
                    "if they are separate"
                )
    unexpected = [
        k for k in state if k not in used and not any(fnmatch.fnmatch(k, p) for p in ignore)
    ]
    if unexpected:
        raise ValueError(
            f"{what}: {len(unexpected)} unexpected key(s) in {state.origin}: "
            f"{listing(unexpected)}; the checkpoint holds weights this model has no place for "
            "(another architecture or head?)"
        )
    absent = sorted(set(expected) - {p for rule in rules for p in rule.paths})
    if absent:
        raise ValueError(
            f"{what}: no weights for the model's parameters {listing(map(_fmt, absent))}"
        )


def convert_rules(state: StateDict, rules: Sequence[Rule], expected: dict):
    """(unrolled path, numpy array in the expected dtype) for each rule's outputs, in the rules'
    order, reading each rule's keys when it is applied (`check_state` first)."""
    for rule in rules:
        structs = [expected[p] for p in rule.paths]
        outs = rule.to_jax(*(state[k] for k in rule.keys), [s.shape for s in structs])
        for path, out, s in zip(rule.paths, outs, structs, strict=True):
            yield path, np.asarray(out).astype(s.dtype)


def export_state(params, rules: Sequence[Rule]) -> dict[str, np.ndarray]:
    """The inverse of `import_state`: unrolled params tree -> {torch key: numpy array}."""
    flat = flatten(nn.unbox(params))
    out = {}
    for rule in rules:
        for path in rule.paths:
            if path not in flat:
                raise ValueError(f"params have no {_fmt(path)}; do they belong to this model?")
        outs = rule.to_torch(*(np.asarray(flat[p]) for p in rule.paths))
        for key, value in zip(rule.keys, outs, strict=True):
            out[key] = np.asarray(value)
    covered = {p for r in rules for p in r.paths}
    extra = sorted(set(flat) - covered)
    if extra:
        raise ValueError(
            f"params hold {listing(map(_fmt, extra))}, which the export has no key for"
        )
    return out


def finish(model: nn.Module, params: dict):
    """Unrolled numpy params -> jax arrays in the model's layout (stacked for scan_layers)."""
    params = jax.tree.map(jnp.asarray, params)
    if getattr(model, "scan_layers", False):
        params = unrolled_to_scanned(params)
    return params


def unrolled(model: nn.Module, params):
    """The params in the unrolled layout (the layout the rules are written for)."""
    params = nn.unbox(params)
    if isinstance(params, dict) and set(params) == {"params"}:
        params = params["params"]
    if getattr(model, "scan_layers", False):
        params = scanned_to_unrolled(params)
    return params
