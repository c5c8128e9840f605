"""Damaged files a run meets: a metrics.jsonl whose last line was cut by a kill (issue 22), a
prepared dataset's dataset_info.json and a checkpoint's preprocessor_config.json that cannot be
read (issue 38), the user's Parquet and Arrow data files cut short or not what they are named
(issue 48)."""

import json
import os
import shutil

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT
from test_files import write_checkpoint_tokenizer

import tfjax.data
from tfjax.data import files, image_folders
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


def test_damaged_parquet_and_arrow_files_are_one_line_naming_the_file(tmp_path):
    """A data file cut short, of random bytes or of the other format is one line naming it (no
    pyarrow traceback): when the run checks its files before any work (its footer or schema:
    all but a stream cut inside its rows), else when the files are opened (every row is read)."""
    table = pa.Table.from_pylist([{"text": f"row {i} " * 8} for i in range(64)])
    good = {"parquet": tmp_path / "good.parquet", "arrow": tmp_path / "good.arrow"}
    pq.write_table(table, good["parquet"], row_group_size=16)
    with pa.ipc.new_stream(str(good["arrow"]), table.schema) as writer:  # as `datasets` writes
        writer.write_table(table, max_chunksize=16)
    with pa.ipc.new_file(str(tmp_path / "format.arrow"), table.schema) as writer:
        writer.write_table(table)
    write_checkpoint_tokenizer(tmp_path / "tok")  # (files.check loads it)
    noise = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    damaged = {
        "cut.parquet": good["parquet"].read_bytes()[:-100],
        "noise.parquet": noise,
        "arrow.parquet": good["arrow"].read_bytes(),
        "middle.parquet": good["parquet"].read_bytes()[:200]
        + noise[:800]
        + good["parquet"].read_bytes()[1000:],  # the footer whole: found reading its rows
        "cut.arrow": good["arrow"].read_bytes()[: good["arrow"].stat().st_size // 2],
        "cut-format.arrow": (tmp_path / "format.arrow").read_bytes()[:-20],
        "noise.arrow": noise,
        "parquet.arrow": good["parquet"].read_bytes(),
    }
    for name, data in damaged.items():
        path = tmp_path / name
        path.write_bytes(data)
        kind = "Parquet" if name.endswith(".parquet") else "Arrow"
        error = (
            rf"^{path} cannot be read as {kind} \(\w+: .+\): the file is damaged, cut short or "
            rf"not {kind}; write it again, or leave it out of the dataset's files$"
        )
        spec = tfjax.data.resolve_config(
            {"train_files": f"{good['parquet']},{path}", "tokenizer": str(tmp_path / "tok")}
        )
        if name not in ("middle.parquet", "cut.arrow"):
            with pytest.raises(files.BadRowsError, match=error):
                files.check(spec)
        else:
            files.check(spec)  # their footer or schema is whole
        with pytest.raises(files.BadRowsError, match=error):
            files.open_files(files.split_files(spec, "train"))
    for path in (*good.values(), tmp_path / "format.arrow"):
        assert (
            len(files.open_files([(path, "arrow" if path.suffix == ".arrow" else "parquet")])) == 64
        )
