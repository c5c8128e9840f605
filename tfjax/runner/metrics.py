"""What a run reports: TensorBoard events, metrics.jsonl and the console line.

`MetricWriter.write(step, split, metrics)` appends one JSON object per call to
`WORKDIR/metrics.jsonl` ({"step": 100, "split": "train", "loss": 2.1, ...}) and the same
scalars to TensorBoard (tag "<split>/<name>"). Only process 0 writes. `read_metrics` reads the
file back (plots, tests, notebooks); `format_line` is the console's train / eval line. Model
FLOPs and MFU are `tfjax.runner.chips`'; progress bars `tfjax.progress`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
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
        self._tb = _summary_writer()(os.path.join(workdir, "tensorboard"))
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


def _summary_writer():
    """tensorboardX's SummaryWriter (imported here: only process 0 needs it), imported without
    torch. tensorboardX imports torch where it is installed, only to accept its tensors, which
    the runner never passes: 1.5-2 s of every run's start on a 2-core host, as long as the rest
    of the runner's imports. With torch already imported it is used as it is."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]  # a later `import torch` imports it
    return SummaryWriter


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
