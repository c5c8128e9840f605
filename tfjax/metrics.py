"""What a run reports: TensorBoard events and metrics.jsonl, the console line, throughput and MFU.

`MetricWriter.write(step, split, metrics)` appends one JSON object per call to
`WORKDIR/metrics.jsonl` ({"step": 100, "split": "train", "loss": 2.1, ...}) and the same
scalars to TensorBoard (tag "<split>/<name>"). Only process 0 writes.

MFU is model FLOPs per second over the matmul throughput measured on the same devices in the
same run (`measure_peak_flops`), so it is comparable across machines without a table of
vendor peaks. Model FLOPs follow Kaplan et al. / PaLM: 6 * N * T for the weight matmuls
(forward 2, backward 4 per parameter per token) plus 12 * L * T * S * D for attention scores
and values; embedding lookups count nothing, a tied output projection counts as a matmul.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging


# ------------------------------------------------------------------------------------ writing
class MetricWriter:
    """metrics.jsonl + TensorBoard in a workdir, written by process 0 only."""

    def __init__(self, workdir: str, *, resume_step: int = 0):
        """On resume, entries after `resume_step` (logged by a run that stopped after its last
        checkpoint) are dropped: the resumed run logs those steps again."""
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if not self.enabled:
            return
        if os.path.exists(self.path):
            _drop_after(self.path, resume_step)
        from tensorboardX import SummaryWriter  # imported here: only process 0 needs it

        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def write(self, step: int, split: str, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {k: _number(v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": int(step), "split": split, **clean}) + "\n")
        self._file.flush()
        for name, value in clean.items():
            if value is not None:
                self._tb.add_scalar(f"{split}/{name}", value, int(step))
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()


def _number(v):
    v = float(v)
    return v if math.isfinite(v) else None  # JSON has no NaN


def _read(path: str) -> tuple[list[dict], bool]:
    """The entries of a metrics.jsonl, and whether it needs rewriting to stay valid JSONL.

    A line that is not a JSON object (the partial last line of a run killed mid-write) is
    skipped with a warning naming the file and line: it must not stop a resume or a plot.
    """
    rows, damaged = [], False
    # errors="replace": a torn write may leave bytes that are not UTF-8; that line is skipped.
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or "step" not in row:
                logging.warning(
                    "%s line %d is not a complete entry (a run killed while writing "
                    "it?); skipped: %.80r",
                    path,
                    number,
                    line,
                )
                damaged = True
                continue
            rows.append(row)
            damaged |= not line.endswith("\n")  # the next entry must not join this line
    return rows, damaged


def _drop_after(path: str, step: int) -> None:
    """Keeps the entries up to `step`, rewriting the file without damaged or later lines."""
    rows, damaged = _read(path)
    keep = [row for row in rows if row["step"] <= step]
    if damaged or len(keep) != len(rows):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in keep)
        os.replace(tmp, path)


def read_metrics(workdir: str, split: str | None = None) -> list[dict]:
    """The entries of a run's metrics.jsonl (of one split when given); damaged lines are
    skipped with a warning."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: is {workdir!r} the workdir of a run?")
    rows, _ = _read(path)
    return [r for r in rows if split is None or r["split"] == split]


def progress(*, total=None, unit="it", desc=None, initial=0, unit_scale=False):
    """A progress bar with its rate and ETA (tqdm) on process 0 in a terminal; elsewhere a
    disabled one with the same methods: logs and notebooks would keep every refresh as a line,
    so callers log a summary (`throughput`) when the wait ends."""
    import tqdm

    shown = jax.process_index() == 0 and sys.stderr.isatty()
    return tqdm.tqdm(
        total=total,
        initial=initial,
        unit=unit,
        desc=desc,
        unit_scale=unit_scale,
        dynamic_ncols=True,
        leave=False,
        disable=not shown,
    )


def throughput(count: float, unit: str, seconds: float) -> str:
    """ "12,288 tokens in 3.1 s (3,964 tokens/s)" """
    rate = f"{count / seconds:,.0f} {unit}/s" if seconds > 0 else "-"
    return f"{count:,.0f} {unit} in {seconds:.1f} s ({rate})"


def format_line(step, total, split, metrics, *, eta_s=None) -> str:
    """One console line: `step 100/1000 train | loss 2.31 | accuracy 0.41 | ... | ETA 0:01:23`."""
    parts = [f"step {step}/{total} {split}"]
    for name, value in metrics.items():
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            continue
        if name == "mfu":
            parts.append(f"MFU {100 * value:.2f}%")
        elif abs(value) >= 1000:
            parts.append(f"{name} {value:,.0f}")
        else:
            parts.append(f"{name} {value:.4g}")
    if eta_s is not None:
        parts.append(f"ETA {time.strftime('%H:%M:%S', time.gmtime(max(eta_s, 0)))}")
    return " | ".join(parts)


# ---------------------------------------------------------------------------------- FLOPs, MFU
def _count(tree) -> int:
    return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree))


def training_flops_per_example(model, params, example: dict) -> float:
    """Model FLOPs of one training example (forward + backward) for the tfjax model families.

    Args:
      model: a tfjax.models Decoder, Encoder, Transformer or VisionTransformer.
      params: its parameters (arrays or ShapeDtypeStructs).
      example: {batch key: shape} of one batch (only lengths and image sizes are read).
    """
    kind = type(model).__name__
    d, layers = model.width, model.num_layers
    if getattr(model, "head_dim", None):  # attention's width N * H, not D (T5, Qwen 3, Gemma)
        d_attention = model.num_heads * model.head_dim
    else:
        d_attention = d
    if kind == "VisionTransformer":
        _, h, w, c = example["image"]
        p = model.patch_size
        n = (h // p) * (w // p)
        t = n + (1 if model.pool == "cls" else 0)
        dense = _count(params["encoder"]) * t + d * c * p * p * n
        dense += _count(params.get("head", {}))
        attention = layers * t * t * d_attention
    elif kind == "Transformer":
        s, t = example["inputs"][1], example["targets"][1]
        out = _count(params["output_proj"]) if "output_proj" in params else model.vocab_size * d
        dense = _count(params["encoder"]) * s + _count(params["decoder"]) * t + out * t
        attention = layers * (s * s + t * t + t * s) * d_attention
    elif kind in ("Decoder", "Encoder"):
        t = example["tokens"][1]
        stack = params["decoder" if kind == "Decoder" else "encoder"]
        if kind == "Decoder":
            tied = "output_proj" not in params
            out = model.vocab_size * d if tied else _count(params["output_proj"])
        elif model.head == "mlm":
            out = _count(params["mlm_dense"]) + model.vocab_size * d
        else:
            out = (_count(params["pooler"]) + _count(params["classifier"])) / t
        dense = _count(stack) * t + out * t
        attention = layers * t * t * d_attention
    else:
        raise ValueError(f"no FLOP count for model type {kind}")
    # forward: 2 per weight and token; attention: Q K^T and weights V, 2 * T * S * N * H each.
    return 3.0 * (2.0 * dense + 4.0 * attention)


@functools.lru_cache(maxsize=8)
def measure_peak_flops(mesh, dtype=jnp.float32, *, size: int | None = None, repeats: int = 5):
    """Matmul FLOP/s of all the mesh's devices together (each multiplies its own matrices).

    The best of `repeats` timed runs of one [n, n] x [n, n] product per device; n is 512 on CPU
    and 4096 elsewhere, large enough to reach the matmul roofline. Measured once per process
    for a mesh and dtype.
    """
    n = size or (512 if jax.default_backend() == "cpu" else 4096)
    devices = mesh.devices.size
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
    x = jax.jit(lambda k: jax.random.normal(k, (devices, n, n), dtype), out_shardings=sharding)(
        jax.random.key(0)
    )
    matmul = jax.jit(lambda a: jnp.einsum("dij,djk->dik", a, a), out_shardings=sharding)
    matmul(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 * devices / best
