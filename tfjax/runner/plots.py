"""Pictures of a run: training / eval curves and attention maps, as PNG files.

    from tfjax.runner import plots
    plots.plot_metrics(workdir)                                   # WORKDIR/plots/curves.png
    weights = plots.attention_weights(model, variables, images)   # {layer name: [B, N, T, S]}
    plots.plot_image_attention(weights, images[0], "attention.png")
    plots.plot_token_attention(weights, ["the", "cat", ...], "attention.png")

Or from the shell: `make plot WORKDIR=...` (python -m tfjax.runner.plots WORKDIR).
"""

import math
import os
import sys
from collections import defaultdict

import flax.linen as nn
import jax
import numpy as np

from tfjax.runner.metrics import read_metrics


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_metrics(workdir: str, out: str | None = None) -> tuple[str, int]:
    """One panel per metric, a line per split (train, eval) against step.

    Returns (path of the PNG, number of panels).
    """
    rows = read_metrics(workdir)
    series = defaultdict(lambda: defaultdict(list))  # metric -> split -> [(step, value)]
    for row in rows:
        for key, value in row.items():
            if key in ("step", "split") or not isinstance(value, int | float):
                continue
            series[key][row.get("split", "train")].append((row["step"], value))
    if not series:
        raise ValueError(f"{workdir}/metrics.jsonl holds no numeric metrics to plot")
    plt = _pyplot()
    names = sorted(series)
    cols = min(3, len(names))
    nrows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for split, points in sorted(series[name].items()):
            steps, values = zip(*sorted(points), strict=True)
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3, label=split)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    fig.suptitle(os.path.basename(os.path.abspath(workdir)))
    # Fixed margins in inches (title, tick labels, "step"), not tight_layout: it draws the
    # figure once more to measure it, a third of the plot's time at the end of every run.
    width, height = fig.get_size_inches()
    fig.subplots_adjust(
        left=0.8 / width,
        right=1 - 0.15 / width,
        bottom=0.5 / height,
        top=1 - 0.75 / height,
        wspace=0.3,
        hspace=0.55,
    )
    out = out or os.path.join(workdir, "plots", "curves.png")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out, len(names)


def attention_weights(model, variables, *inputs, **kwargs) -> dict[str, np.ndarray]:
    """Runs the model once, collecting each attention layer's weights.

    Returns {layer path: [B, N, T, S] array}, in layer order; scanned stacks are split into
    one entry per layer.
    """
    _, state = model.apply(variables, *inputs, mutable=["intermediates"], **kwargs)
    found = {}
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(state["intermediates"]))[0]
    for path, value in flat:
        keys = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
        if "attention_weights" not in keys:
            continue
        name = "/".join(k for k in keys if k not in ("attention_weights", "0"))
        value = np.asarray(value)
        if value.ndim == 5:  # scanned: [L, B, N, T, S]
            for i, layer in enumerate(value):
                found[name.replace("layers/", f"layers_{i}/")] = layer
        else:
            found[name] = value

    def order(name):  # layers_10 after layers_9
        return [int(p) if p.isdigit() else p for p in name.replace("_", "/").split("/")]

    return {k: found[k] for k in sorted(found, key=order)}


def _grid(weights, title):
    plt = _pyplot()
    layers = list(weights)
    heads = next(iter(weights.values())).shape[1]
    fig, axes = plt.subplots(
        heads, len(layers), figsize=(2.2 * len(layers), 2.2 * heads), squeeze=False
    )
    fig.suptitle(title)
    return plt, fig, axes, layers, heads


def plot_image_attention(
    weights: dict, image, out: str, *, example: int = 0, query: int = 0
) -> tuple[str, int]:
    """Heads x layers: where one query token (the class token by default) looks, over the image.

    weights: from `attention_weights` of a ViT with a class token; image: [H, W, C].
    Returns (path, number of panels).
    """
    plt, fig, axes, layers, heads = _grid(weights, f"attention of token {query} (rows: heads)")
    image = np.asarray(image, np.float32)
    shown = (image - image.min()) / max(float(np.ptp(image)), 1e-6)
    shown = shown[..., 0] if shown.shape[-1] == 1 else shown
    for j, layer in enumerate(layers):
        w = weights[layer][example]  # [N, T, S]
        side = math.isqrt(w.shape[-1])  # a square grid of patches after any class token
        prefix = w.shape[-1] - side * side
        for h in range(heads):
            row = w[h, query, prefix:].reshape(side, side)
            ax = axes[h, j]
            ax.imshow(shown, cmap="gray" if shown.ndim == 2 else None)
            ax.imshow(
                row,
                cmap="inferno",
                alpha=0.6,
                extent=(-0.5, image.shape[1] - 0.5, image.shape[0] - 0.5, -0.5),
                interpolation="nearest",
            )
            ax.set_xticks([])
            ax.set_yticks([])
            if h == 0:
                ax.set_title(layer.split("/")[-2] if "/" in layer else layer, fontsize=8)
    return _save(plt, fig, out, heads * len(layers))


def plot_token_attention(
    weights: dict,
    tokens: list[str],
    out: str,
    *,
    example: int = 0,
    key_tokens: list[str] | None = None,
) -> tuple[str, int]:
    """Heads x layers heatmaps of [T, S] weights with the tokens as axis labels."""
    plt, fig, axes, layers, heads = _grid(weights, "attention (rows: heads, columns: layers)")
    key_tokens = tokens if key_tokens is None else key_tokens
    for j, layer in enumerate(layers):
        w = weights[layer][example]
        for h in range(heads):
            ax = axes[h, j]
            ax.imshow(w[h, : len(tokens), : len(key_tokens)], cmap="viridis", vmin=0, vmax=1)
            ax.set_xticks(range(len(key_tokens)), key_tokens, rotation=90, fontsize=5)
            ax.set_yticks(range(len(tokens)), tokens, fontsize=5)
            if h == 0:
                ax.set_title(layer, fontsize=6)
    return _save(plt, fig, out, heads * len(layers))


def _save(plt, fig, out, panels):
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out, panels


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tfjax.runner.plots WORKDIR")
    path, panels = plot_metrics(sys.argv[1])
    print(f"wrote {path} ({panels} panels)")
