"""Curves and attention maps are written as non-empty PNGs with the expected panels."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.models import decoder, transformer, vit
from tfjax.runner import plots


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_curves_one_panel_per_metric(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(0, 50, 10):
            f.write(
                json.dumps(
                    {"step": step, "split": "train", "loss": 1 / (step + 1), "learning_rate": 1e-3}
                )
                + "\n"
            )
        f.write(json.dumps({"step": 40, "split": "eval", "loss": 0.3, "accuracy": 0.9}) + "\n")
    path, panels = plots.plot_metrics(str(tmp_path))
    assert panels == 3  # accuracy, learning_rate, loss
    width, height = _png_size(path)
    assert width > 300 and height > 200


def test_curves_missing_workdir_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist"):
        plots.plot_metrics(str(tmp_path / "nope"))


@pytest.mark.parametrize("scan", [False, True])
def test_vit_attention_over_the_image(tmp_path, scan):
    m = vit.Model(variant="tiny/2", num_classes=10, scan_layers=scan)
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 1))
    v = m.init(jax.random.key(1), x)
    weights = plots.attention_weights(m, v, x)
    assert list(weights) == ["encoder/layers_0/self_attention", "encoder/layers_1/self_attention"]
    assert all(w.shape == (2, 4, 17, 17) for w in weights.values())
    np.testing.assert_allclose(sum(weights.values()).sum(-1), 2.0, rtol=1e-5)
    path, panels = plots.plot_image_attention(weights, x[0], str(tmp_path / "att.png"))
    assert panels == 4 * 2
    assert _png_size(path)[0] > 100


def test_text_attention_with_token_labels(tmp_path):
    m = transformer.Model(variant="tiny", vocab_size=30)
    src, tgt = jnp.arange(1, 7)[None], jnp.arange(2, 7)[None]
    weights = plots.attention_weights(m, m.init(jax.random.key(0), src, tgt), src, tgt)
    # 2 encoder self, 2 decoder self and 2 cross-attention layers.
    assert len(weights) == 6 and weights["decoder/layers_1/cross_attention"].shape == (1, 4, 5, 6)
    self_only = {k: w for k, w in weights.items() if k.startswith("decoder") and "self" in k}
    path, panels = plots.plot_token_attention(self_only, list("abcde"), str(tmp_path / "t.png"))
    assert panels == 4 * 2 and _png_size(path)[1] > 100
    d = decoder.Model(variant="tiny", vocab_size=30)
    w = plots.attention_weights(d, d.init(jax.random.key(0), src), src)
    upper = np.triu(np.ones((6, 6), bool), 1)
    assert all(np.all(x[0][:, upper] == 0) for x in w.values())  # causal
