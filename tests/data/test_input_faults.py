"""Damaged files a run meets (issue 22): a metrics.jsonl whose last line was cut by a kill."""

import json
import os

import jax
from conftest import ROOT

from tfjax.runner import metrics, plots, train


def _lines(path):
    with open(path) as f:
        text = f.read()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]  # every line is a whole entry


def test_resume_after_a_partial_metrics_line(data_dir, tmp_path, caplog):
    workdir = str(tmp_path)
    config = train.load_config(os.path.join(ROOT, "configs/vit.py:tiny"))
    config.data_dir = data_dir
    train.train_and_evaluate(config, workdir, devices=jax.devices()[:1])  # checkpoint at step 2
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path, "a") as f:  # killed while writing step 3's entry
        f.write('{"step": 3, "split": "train", "lo')
    with open(path) as f:
        partial = len(f.readlines())

    config.num_train_steps = 4
    with caplog.at_level("WARNING"):
        train.train_and_evaluate(config, workdir, devices=jax.devices()[:1])
    assert f"{path} line {partial} is not a complete entry" in caplog.text
    assert [r["step"] for r in _lines(path) if r["split"] == "train"] == [1, 2, 3, 4]


def test_partial_lines_are_skipped_when_reading_and_never_joined(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    entries = [{"step": s, "split": "train", "loss": 1.0 / s} for s in (1, 2, 3)]
    text = "".join(json.dumps(e) + "\n" for e in entries)
    path.write_text(text + '{"step": 4, "spl')
    with caplog.at_level("WARNING"):
        assert metrics.read_metrics(str(tmp_path)) == entries
        assert plots.plot_metrics(str(tmp_path))[1] == 1  # the loss panel
    assert f"{path} line 4 is not a complete entry" in caplog.text

    # A whole last entry without its newline (cut just before it) is kept, and the next entry
    # a resumed run appends goes on a line of its own.
    path.write_text(text.rstrip("\n"))
    writer = metrics.MetricWriter(str(tmp_path), resume_step=3)
    writer.write(4, "train", {"loss": 0.25})
    writer.close()
    assert _lines(path) == [*entries, {"step": 4, "split": "train", "loss": 0.25}]
