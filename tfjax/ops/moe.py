"""Mixture-of-experts maths: routing, dropless dispatch by grouped matmuls, auxiliary losses.

Letters: N tokens, D model width, F expert width, E experts, k experts per token (top_k),
R = N k routed (token, expert) pairs.

    weights, experts, scores = route(logits, 2)                           # [N, k], [N, k], [N, E]
    y = experts_ffn(x, weights, experts, kernels, activation="swiglu", num_experts=E)  # [N, D]

Dispatch is dropless (as MegaBlocks, Gale et al., 2022): the R pairs are sorted by expert, each
expert's rows multiplied by its kernels in one grouped matmul (`grouped_matmul`, whose groups
are the experts' row counts; it chooses the kernel per target), and the outputs put back in
token order by a gather (no scatter-add: deterministic on every backend) and summed with the
router's weights. No capacity factor, nothing dropped, no padding to a capacity.

Expert parallelism: with a `sharding` (tfjax.nn resolves it from the logical rules in context)
`experts_ffn` runs per device under `jax.shard_map`, manual over the mesh axes that split the
tokens or the experts (the others, tensor parallelism of F, stay with the compiler). A device
holds E / P experts; the token exchange is chosen here alone: over the mesh axes that split
both, each device gathers its group's tokens and their routes (all-gather), computes the pairs
routed to its own experts, and the partial outputs go back summed to the devices that hold
the tokens (reduce-scatter); over expert axes that do not split the tokens (those are already
on every device) the partial outputs are summed (all-reduce). Kernel dimensions that FSDP
splits over manual axes are gathered inside (their gradients leave reduce-scattered, as FSDP's
do). Sorting stays local to each device: the compiler never sorts the global batch.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from tfjax.ops import axes
from tfjax.ops.activations import by_name
from tfjax.ops.attention import target_platform

# The names both module systems (tfjax.nn's MoeMlp, tfjax.nnx's) give a mixture's state.
AUX_LOSSES = "aux_losses"  # the collection of the layers' auxiliary losses (scalars)
EXPERTS = "experts"  # the name of the module that holds the expert kernels


def route(
    logits,
    top_k: int,
    *,
    score: str = "softmax",
    renormalize: bool = True,
    score_bias=None,
    groups: int = 1,
    groups_kept: int | None = None,
    scale: float = 1.0,
):
    """The router's choice from its logits [N, E]: (weights [N, k], experts [N, k] int32,
    scores [N, E]), in float32 or wider.

    score: "softmax" (over the E experts; Mixtral, Qwen-MoE) or "sigmoid" (each on its own,
    DeepSeek-V3); the k experts of highest score are chosen, their scores the weights, divided
    by their sum with `renormalize`, times `scale`. Softmax, top-k and renormalization equal
    GPT-OSS's softmax of the top-k logits.

    DeepSeek-V3's choice (its weights stay the scores above): score_bias [E] (a correction kept
    for balance, not trained: no gradient reaches it) is added to the scores for choosing only;
    with `groups` G > 1 the E experts are G groups of E / G, each scored by the sum of its two
    best (biased) scores, and only the experts of the `groups_kept` best groups (all when None)
    may be chosen; `scale` is its routed_scaling_factor.
    """
    logits = _at_least_float32(logits)
    scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    choice = scores
    if score_bias is not None:
        choice = scores + jax.lax.stop_gradient(score_bias).astype(scores.dtype)
    if groups > 1 and groups_kept is not None and groups_kept < groups:
        n, e = choice.shape
        # [N, G, E / G] -> [N, G]: each group's two best scores, summed
        grouped = choice.reshape(n, groups, e // groups)
        best = jax.lax.top_k(grouped, min(2, e // groups))[0].sum(axis=-1)
        _, kept = jax.lax.top_k(best, groups_kept)  # [N, groups_kept]
        keep = jnp.zeros((n, groups), bool).at[jnp.arange(n)[:, None], kept].set(True)
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, e)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * scale if scale != 1.0 else weights, experts, scores


def load_balance_loss(scores, experts, num_experts: int):
    """The load-balancing loss of Switch Transformers (Fedus et al., 2021, eq. 4) for top-k
    routing: E * sum_e f_e P_e, f_e the fraction of the N tokens that chose expert e among their
    k, P_e the mean of e's score (per token the scores normalised to sum 1; softmax's already
    do). Balanced routing gives k: transformers' load_balancing_loss_func (Mixtral, Qwen-MoE,
    GPT-OSS), so their router_aux_loss_coef means the same weight here (they average f and P
    over all layers' tokens at once; this is one layer's).

    scores [N, E], experts [N, k] -> []; its gradient reaches the scores (f counts).
    """
    n = experts.shape[0]
    counts = jnp.bincount(experts.reshape(-1), length=num_experts)  # [E]
    fraction = counts.astype(scores.dtype) / n
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def router_z_loss(logits):
    """ST-MoE's router z-loss (Zoph et al., 2022, eq. 5): the mean over tokens of
    logsumexp(logits)^2, which keeps the router's logits small. [N, E] -> []."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(_at_least_float32(logits), axis=-1)))


def aux_losses(logits, scores, experts, config) -> dict:
    """A router's auxiliary losses from its logits [N, E], scores [N, E] and chosen experts
    [N, k], weighted as `config` (a MoeConfig) says: {"load_balance", "router_z", "loss"}, the
    last their weighted sum (what a trainer adds to its loss)."""
    load_balance = load_balance_loss(scores, experts, config.num_experts)
    router_z = router_z_loss(logits)
    loss = config.load_balance_weight * load_balance + config.router_z_weight * router_z
    return {"load_balance": load_balance, "router_z": router_z, "loss": loss}


def grouped_matmul(rows, kernel, group_sizes, *, implementation: str | None = None):
    """rows [R, I], sorted by group (group g: group_sizes[g] rows, then any rows of no group,
    whose outputs are undefined) times kernel [G, I, O] -> [R, O] in rows' dtype.

    The one place that chooses the kernel (benchmarks/moe_dispatch.py measures them), by the
    target (`implementation` forces one: "xla", "megablox" or "tokamax"):
    - TPU: Megablox's grouped matmul (in JAX), whose VJP computes the kernel's gradient grouped
      (tgmm); libtpu lowers ragged_dot's kernel gradient densely, E times the routed FLOPs. Its
      tiles need I and O of at least 128 (every published MoE); smaller ones take ragged_dot.
    - GPU: Tokamax's Mosaic GPU kernel where Tokamax is installed (the cuda extra): 3-38x
      faster than XLA's ragged_dot, forward and backward, on an H200 (the README's figures).
    - CPU: XLA's jax.lax.ragged_dot.
    A Pallas kernel is one device's program, so a kernel is chosen only where no mesh axis is
    left to the compiler's partitioner (one device, or every split axis manual in shard_map);
    elsewhere XLA's ragged_dot, which the partitioner splits.
    """
    kernel = kernel.astype(rows.dtype)
    if implementation is None:
        implementation = _grouped_matmul_implementation()
        if implementation == "megablox" and min(kernel.shape[1:]) < _MEGABLOX_MIN:
            implementation = "xla"
    if implementation == "megablox":
        return _megablox(rows, kernel, group_sizes)
    if implementation == "tokamax":
        import tokamax

        # Tokamax's own XLA path where its kernel does not support the GPU (before Hopper).
        return tokamax.ragged_dot(rows, kernel, group_sizes, implementation=("mosaic_gpu", "xla"))
    if implementation != "xla":
        raise ValueError(
            f"grouped_matmul: implementation {implementation!r} is not one of "
            "'xla', 'megablox', 'tokamax'"
        )
    return jax.lax.ragged_dot(rows, kernel, group_sizes)


def _grouped_matmul_implementation() -> str:
    mesh = jax.sharding.get_abstract_mesh()
    # Inside shard_map Mosaic needs every axis manual, size-1 ones too; outside, one device.
    manual = [kind == jax.sharding.AxisType.Manual for kind in mesh.axis_types]
    partitioned = not all(manual) if any(manual) else math.prod(mesh.axis_sizes) > 1
    platform = target_platform()
    if partitioned or platform == "cpu":
        return "xla"
    if platform == "tpu":
        return "megablox"
    if platform == "gpu" and _tokamax_installed():
        return "tokamax"
    return "xla"


def _tokamax_installed() -> bool:
    try:
        import tokamax  # noqa: F401
    except ImportError:
        return False
    return True


# Megablox's tiles: rows, then one size for I and O (its VJP swaps their roles, so a tile must
# suit both): MaxText's defaults for v5p-class chips (512, 1024), clamped to the problem in
# multiples of the TPU's 128 lanes; rows are padded to a whole number of row tiles.
_MEGABLOX_ROWS, _MEGABLOX_COLUMNS, _MEGABLOX_MIN = 512, 1024, 128


def _megablox(rows, kernel, group_sizes):
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    r = rows.shape[0]
    # Megablox leaves the rows of no group undefined, their input gradients too (the sharded
    # path's pairs routed to other devices): both are zeroed, by selects, which keep no NaN.
    grouped = (jnp.arange(r) < jnp.sum(group_sizes))[:, None]
    rows = jnp.where(grouped, rows, 0)
    tm = min(_MEGABLOX_ROWS, -(-r // _MEGABLOX_MIN) * _MEGABLOX_MIN)
    tile = min(_MEGABLOX_COLUMNS, min(kernel.shape[1:]) // _MEGABLOX_MIN * _MEGABLOX_MIN)
    out = megablox.gmm(
        jnp.pad(rows, ((0, -(-r // tm) * tm - r), (0, 0))),
        kernel,
        group_sizes.astype(jnp.int32),
        rows.dtype,
        (tm, tile, tile),
        None,
        None,
        False,
        target_platform() != "tpu",  # interpreted off a TPU (forced, as the CPU tests do)
    )
    return jnp.where(grouped, out[:r], 0)


def _at_least_float32(x):
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _project(rows, group_sizes, row_experts, kernel, bias):
    """Each row [R, I] times its expert's kernel [E_l, I, O] (rows sorted by expert, group i of
    group_sizes[i] rows), plus its expert's bias [E_l, O] -> [R, O]."""
    out = grouped_matmul(rows, kernel, group_sizes)
    if bias is not None:
        # Rows of no local expert (index E_l) take the last bias; they are zeroed by the caller.
        out = out + jnp.take(bias.astype(out.dtype), row_experts, axis=0, mode="clip")
    return out


def expert_mlp(rows, group_sizes, row_experts, kernels: dict, biases: dict | None, activation):
    """The experts' MLPs of rows sorted by expert [R, D] -> [R, D]: wo(act(wi(x))) or, gated,
    wo(unit(wi_0(x), wi_1(x))); `kernels` {"wi" or "wi_0" and "wi_1": [E_l, D, F], "wo":
    [E_l, F, D]}, `biases` alike ([E_l, F], [E_l, D]) or None; row_experts [R] each row's;
    `activation` a name (tfjax.ops.activations) or its function (a config's activation_fn)."""
    biases = biases or {}
    act = by_name(activation) if isinstance(activation, str) else activation

    def proj(x, name):
        return _project(x, group_sizes, row_experts, kernels[name], biases.get(name))

    if "wi_0" in kernels:  # gated
        h = act(proj(rows, "wi_0"), proj(rows, "wi_1"))
    else:
        h = act(proj(rows, "wi"))
    return proj(h, "wo")


def experts_ffn(
    x,
    weights,
    experts,
    kernels: dict,
    biases: dict | None = None,
    *,
    activation,
    num_experts: int,
    first_expert=0,
    weigh_inputs: bool = False,
):
    """sum_j weights[n, j] * expert_{experts[n, j]}(x[n]) for tokens x [N, D] -> [N, D]; with
    `weigh_inputs`, sum_j expert_{experts[n, j]}(weights[n, j] * x[n]) (Llama 4).

    `kernels` (and `biases`, see expert_mlp) hold experts first_expert .. first_expert + E_l - 1
    of the num_experts: their leading axis, E_l, is num_experts on one device, E / P on each of P
    expert shards (first_expert, an int or a traced one, then says which). Pairs routed to other
    experts add nothing here: their shard computes them.
    """
    n, k = experts.shape
    num_local = kernels["wo"].shape[0]
    # [R]: each pair's local expert, num_local for the others, which sort last.
    local = experts.reshape(-1) - first_expert
    key = jnp.where((local >= 0) & (local < num_local), local, num_local)
    order = jnp.argsort(key, stable=True)  # [R]: pair order[r] goes to row r
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local]  # [E_l]
    # [R, D]: the rows, grouped by expert
    rows = jnp.take(x, order // k, axis=0)
    if weigh_inputs:  # each row times its pair's weight, and the outputs summed as they are
        rows = rows * jnp.take(weights.reshape(-1), order)[:, None].astype(rows.dtype)
        weights = jnp.ones_like(weights)
    out = expert_mlp(rows, group_sizes, key[order], kernels, biases, activation)
    if num_local < num_experts:  # the rows past the local groups are not defined by ragged_dot
        routed_here = jnp.arange(n * k) < jnp.sum(group_sizes)
        out = jnp.where(routed_here[:, None], out, 0)
    # Back in pair order by the inverse permutation (a gather, in the backward pass too).
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    # [N, k, D]
    out = jnp.take(out, inverse, axis=0).reshape(n, k, -1)
    # [N, D]
    return jnp.einsum("nkd,nk->nd", out, weights.astype(out.dtype))


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
    """How the mesh in context splits an MoE layer's arrays (tfjax.nn.moe resolves it from the
    logical axis rules)."""

    tokens: tuple[str, ...]  # mesh axes that split the tokens [N] (the batch's, then length's)
    experts: tuple[str, ...]  # mesh axes that split the experts [E], in the kernels' order
    kernels: dict  # name -> PartitionSpec of each kernel (and "<name>_bias" of its bias)


def mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry, as a tuple."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _manual_spec(spec, manual):
    """`spec` with only the manual mesh axes (shard_map's specs name no others)."""
    return PartitionSpec(*(tuple(a for a in mesh_axes(e) if a in manual) or None for e in spec))


def sharded_experts_ffn(
    x,
    weights,
    experts,
    kernels: dict,
    biases: dict | None = None,
    *,
    sharding: ExpertSharding | None = None,
    **plain,
):
    """`experts_ffn` (its keyword arguments `plain`: activation, num_experts, weigh_inputs) on
    the mesh in context, each device computing its experts (see the module docstring); without
    a mesh or a `sharding`, or when the tokens do not split evenly over their mesh axes
    (decoding fewer rows than devices), the plain function under the compiler's partitioning."""
    mesh = jax.sharding.get_abstract_mesh()
    if sharding is None or mesh.empty:
        return experts_ffn(x, weights, experts, kernels, biases, **plain)
    split = sharding.tokens + sharding.experts
    token_parts = math.prod(mesh.shape[a] for a in sharding.tokens)
    if not any(a in split for a in mesh.axis_names) or x.shape[0] % token_parts:
        return experts_ffn(x, weights, experts, kernels, biases, **plain)
    # Size-1 axes manual too: no change to the program, and with no axis left to the compiler
    # the grouped matmul may be a kernel (grouped_matmul).
    manual = tuple(a for a in mesh.axis_names if a in split or mesh.shape[a] == 1)
    exchange = tuple(a for a in sharding.experts if a in sharding.tokens)  # gather, scatter
    summed = tuple(a for a in sharding.experts if a not in sharding.tokens)  # all-reduce
    biases = biases or {}
    specs = {name: _manual_spec(sharding.kernels[name], manual) for name in kernels}
    bias_specs = {name: _manual_spec(sharding.kernels[f"{name}_bias"], manual) for name in biases}
    tokens = PartitionSpec(sharding.tokens or None, None)

    def per_device(x, weights, experts, kernels, biases):
        # FSDP: the kernels' other dimensions whole, as the matmuls need them.
        def whole(w, spec):
            for dim in range(1, w.ndim):
                axes = mesh_axes(spec[dim] if dim < len(spec) else None)
                if axes:
                    w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
            return w

        kernels = {name: whole(w, specs[name]) for name, w in kernels.items()}
        biases = {name: whole(b, bias_specs[name]) for name, b in biases.items()}
        if exchange:  # the tokens of every device that shares these experts
            x, weights, experts = (
                jax.lax.all_gather(a, exchange, axis=0, tiled=True) for a in (x, weights, experts)
            )
        num_local = kernels["wo"].shape[0]
        first = jax.lax.axis_index(sharding.experts) * num_local if sharding.experts else 0
        y = experts_ffn(x, weights, experts, kernels, biases or None, **plain, first_expert=first)
        if exchange:  # each token's sum over the experts, back on its device
            y = jax.lax.psum_scatter(y, exchange, scatter_dimension=0, tiled=True)
        if summed:
            y = jax.lax.psum(y, summed)
        return y

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, specs, bias_specs),
        out_specs=tokens,
        axis_names=set(manual),
        # Megablox's pallas_call (jax 0.10) declares no varying axes for its outputs, which
        # the check refuses; the collectives above are explicit, as the check would make them.
        check_vma=False,
    )(x, weights, experts, kernels, biases)


def expert_sharding(names: dict) -> ExpertSharding | None:
    """The ExpertSharding the rules and mesh in context give kernels of logical `names` (name
    -> axes); None outside `tfjax.sharding.logical_context`. Reads Flax's logical axis rules
    (imported when called: tfjax.ops imports no Flax)."""
    import flax.linen as nn

    if jax.sharding.get_abstract_mesh().empty or not nn.get_logical_axis_rules():
        return None
    tokens = nn.logical_to_mesh_axes((axes.BATCH, axes.LENGTH))
    specs = {name: nn.logical_to_mesh_axes(n) for name, n in names.items()}
    return ExpertSharding(
        tokens=sum((mesh_axes(e) for e in tokens), ()),
        experts=mesh_axes(specs["wo"][0]),
        kernels=specs,
    )


def expert_names(config) -> dict:
    """Each expert parameter's logical axes (kernels by name; "<name>_bias" for biases) of a
    MoeConfig `config`."""
    wi = ("wi_0", "wi_1") if config.gated else ("wi",)
    names = {name: (axes.EXPERTS, axes.EMBED, axes.MLP) for name in wi}
    names["wo"] = (axes.EXPERTS, axes.MLP, axes.EMBED)
    return names | {f"{name}_bias": (n[0], n[2]) for name, n in names.items()}


def stacked_init(init: Callable) -> Callable:
    """An initializer of [E, ...] kernels: `init` of one [...] kernel per expert (a fan-in
    initializer must not count E as fan)."""

    def stacked(key, shape, dtype=jnp.float32):
        keys = jax.random.split(key, shape[0])
        return jax.vmap(lambda k: init(k, shape[1:], dtype))(keys)

    return stacked
