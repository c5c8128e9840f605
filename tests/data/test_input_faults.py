"""Damaged files a run meets: a metrics.jsonl whose last line was cut by a kill (issue 22), a
prepared dataset's dataset_info.json and a checkpoint's preprocessor_config.json that cannot be
read (issue 38)."""

import json
import os
import shutil

import jax
import pytest
from conftest import ROOT

from tfjax.data import image_folders
from tfjax.data import sources as td
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


def test_unreadable_dataset_info_is_named_and_prepare_sets_it_aside(data_dir, tmp_path, caplog):
    """tfds cannot read the info file: reading names it and says what to do; prepare (what a
    run does first for an embedded dataset) moves the folder aside, deleting nothing, and builds
    it again, as often as it is damaged."""
    td.prepare("digits", data_dir)
    shutil.copytree(f"{data_dir}/digits", tmp_path / "digits")
    (version,) = os.listdir(tmp_path / "digits")
    folder = tmp_path / "digits" / version
    info = folder / "dataset_info.json"
    for n, text in enumerate(("{garbage", '{"name": "digits"}'), 1):  # not JSON; no version
        info.write_text(text)
        with pytest.raises(
            ValueError,
            match=rf"^dataset 'digits': {info} cannot be read by tfds \(\w+: .*\); the "
            r"prepared folder is damaged: run `python -c .*tfjax\.data\.prepare\('digits'",
        ):
            td.open_source("digits", "train", tmp_path)
        kept = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
        with caplog.at_level("WARNING"):
            assert td.prepare("digits", tmp_path) == str(folder)
        aside = tmp_path / "digits" / f"{version}.damaged-{n}"
        assert (
            f"{info} cannot be read by tfds" in caplog.text
            and f"moved it to {aside}" in caplog.text
        )
        assert len(td.open_source("digits", "train", tmp_path)) == 1498
        assert {name: (aside / name).read_bytes() for name in os.listdir(aside)} == kept


def test_unreadable_preprocessor_config_is_named(tmp_path):
    path = tmp_path / "preprocessor_config.json"
    for text, wrong in (
        ("{garbage", r" is not valid JSON \(Expecting"),
        ("[1]", r" holds a JSON list; an image processor's config .* is a JSON object"),
        (
            '{"do_resize": true, "size": {"height": "a", "width": 8}, "resample": 2}',
            r": size\.height='a': must be a number",
        ),
        (
            '{"do_resize": true, "size": {"height": 8, "width": 8}, "resample": 99}',
            r": resample=99 is not one of PIL's filters",
        ),
        (
            '{"do_rescale": true, "rescale_factor": [1]}',
            r": rescale_factor=\[1\]: must be a number",
        ),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=rf"^{path}{wrong}"):
            image_folders.Preprocessor.read(str(tmp_path))
