"""Loader behaviour on the embedded datasets: determinism, sharding, resumption, fixed shapes,
and the errors for bad input."""

import collections
import dataclasses
import glob
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, plain_env

import tfjax.data as td
from tfjax.data import embedded


@pytest.fixture(scope="session")
def data_dir(data_dir):  # the session's (conftest.py), with these prepared
    path = pathlib.Path(data_dir)
    for name in ("digits", "pydoc"):
        td.prepare(name, path)
    return path


def take(loader, n):
    return [next(loader) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def rows(batches, keys=("image", "label")):
    """Multiset of the real (weight 1) examples of classification batches."""
    out = collections.Counter()
    for b in batches:
        for i in np.flatnonzero(b["weights"]):
            out[tuple(b[k][i].tobytes() for k in keys)] += 1
    return out


def test_number_words_and_splits():
    assert embedded.number_to_words(0) == "zero"
    assert embedded.number_to_words(15) == "fifteen"
    assert embedded.number_to_words(40) == "forty"
    assert embedded.number_to_words(1000) == "one thousand"
    assert embedded.number_to_words(90019) == "ninety thousand nineteen"
    assert embedded.number_to_words(432105) == "four hundred thirty-two thousand one hundred five"
    words = [embedded.number_to_words(n) for n in range(1_000_000)[::997]]
    assert max(len(w.split()) for w in words) <= 12
    train, test = embedded.numbers_split("train"), embedded.numbers_split("test")
    assert len(test) == 1000 and len(train) > 60_000
    assert not set(train.tolist()) & set(test.tolist())  # held-out numbers
    np.testing.assert_array_equal(test, embedded.numbers_split("test"))  # fixed


def test_prepare_is_idempotent_and_splits_are_fixed(data_dir):
    files = sorted(glob.glob(f"{data_dir}/digits/**/*", recursive=True))
    mtimes = [os.path.getmtime(f) for f in files]
    assert td.prepare("digits", data_dir) == td.prepare("digits", data_dir)
    assert [os.path.getmtime(f) for f in files] == mtimes
    assert len(td.open_source("digits", "train", data_dir)) == 1498
    assert len(td.open_source("digits", "test", data_dir)) == 299
    pydoc_train = {r["text"] for r in td.open_source("pydoc", "train", data_dir, cache=True)}
    pydoc_test = {r["text"] for r in td.open_source("pydoc", "test", data_dir, cache=True)}
    assert len(pydoc_train) > 1500 and len(pydoc_test) > 150
    assert not pydoc_test & pydoc_train  # held-out paragraphs


def test_concurrent_prepares_build_the_dataset_once(tmp_path):
    """Two processes preparing one dataset in one data_dir (two jobs, two test workers): one
    builds it while the other waits for the lock, then finds it prepared."""
    code = "import sys, tfjax.data as td; print(td.prepare('digits', sys.argv[1]))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            cwd=ROOT,
            env=plain_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    folders = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(folders) == 1
    versions = os.listdir(os.path.dirname(folders.pop()))
    assert len(versions) == 1, versions  # no damaged or half-built copy beside it
    assert len(td.open_source("digits", "train", str(tmp_path))) == 1498


@pytest.mark.parametrize("config", [{"name": "digits"}, {"name": "pydoc", "task": "mlm"}])
def test_seed_fixes_the_batches(data_dir, config):
    def batches(seed):
        with td.make_loader(
            config,
            split="train",
            batch_size=16,
            seed=seed,
            shuffle=True,
            num_epochs=None,
            data_dir=data_dir,
        ) as loader:
            return take(loader, 3)

    first = batches(0)
    assert_same_batches(first, batches(0))
    other = batches(1)
    key = "image" if "image" in first[0] else "tokens"
    assert not np.array_equal(first[0][key], other[0][key])


def test_augmentation_only_in_training(data_dir):
    def first_image(augment, seed):
        with td.make_loader(
            {"name": "digits"},
            split="test",
            batch_size=8,
            seed=seed,
            shuffle=False,
            num_epochs=1,
            data_dir=data_dir,
            augment=augment,
        ) as loader:
            return next(loader)["image"]

    plain = first_image(False, 0)
    np.testing.assert_array_equal(plain, first_image(False, 1))  # nothing random in eval
    assert not np.array_equal(plain, first_image(True, 0))  # random shifts in training
    assert plain.min() >= -1 and plain.max() <= 1


@pytest.mark.parametrize("process_count", [2, 3])
def test_process_shards_are_disjoint_and_cover_the_epoch(data_dir, process_count):
    batch_size = 64
    everything = rows(
        td.make_loader(
            {"name": "digits"},
            split="train",
            batch_size=batch_size,
            seed=0,
            shuffle=False,
            num_epochs=1,
            process_index=0,
            process_count=1,
            data_dir=data_dir,
        )
    )
    assert sum(everything.values()) == 1498
    for epochs in (1, 2):
        shards = []
        for index in range(process_count):
            loader = td.make_loader(
                {"name": "digits"},
                split="train",
                batch_size=batch_size,
                seed=3,
                shuffle=True,
                num_epochs=epochs,
                process_index=index,
                process_count=process_count,
                data_dir=data_dir,
                augment=False,
            )
            batches = list(loader)
            assert len(batches) == loader.num_batches  # the same step count on every host
            assert all(b["image"].shape == (batch_size, 8, 8, 1) for b in batches)
            shards.append(rows(batches))
        union = sum(shards, collections.Counter())
        assert union == collections.Counter({k: epochs * v for k, v in everything.items()})
        if epochs == 1:  # disjoint (up to images that occur twice in the dataset itself)
            for a in range(process_count):
                for b in range(a + 1, process_count):
                    for key in shards[a].keys() & shards[b].keys():
                        assert shards[a][key] + shards[b][key] <= everything[key]


def test_epochs_are_reshuffled(data_dir):
    n = 64
    with td.make_loader(
        {"name": "digits"},
        split=f"train[:{n}]",
        batch_size=n,
        seed=0,
        shuffle=True,
        num_epochs=2,
        data_dir=data_dir,
        augment=False,
    ) as loader:
        first, second = list(loader)
    assert rows([first]) == rows([second])  # the same examples ...
    assert not np.array_equal(first["label"], second["label"])  # ... in another order


def test_last_partial_batch_is_padded(data_dir):
    with td.make_loader(
        {"name": "digits"},
        split="test",
        batch_size=64,
        seed=0,
        shuffle=False,
        num_epochs=1,
        data_dir=data_dir,
    ) as loader:
        batches = list(loader)
    assert loader.num_batches == len(batches) == 5
    assert {b["image"].shape for b in batches} == {(64, 8, 8, 1)}
    last = batches[-1]
    np.testing.assert_array_equal(last["weights"], np.arange(64) < 299 - 4 * 64)
    assert not last["image"][299 - 4 * 64 :].any()


STATE_CONFIGS = {
    "digits": ({"name": "digits"}, "train[:40]"),
    "lm_packed": ({"name": "pydoc", "seq_len": 64}, "train[:60]"),
    "mlm_packed": ({"name": "pydoc", "task": "mlm", "seq_len": 64}, "train[:60]"),
    "lm_padded": ({"name": "pydoc", "packing": False, "seq_len": 64}, "train[:30]"),
}


@pytest.mark.parametrize("name", STATE_CONFIGS)
@pytest.mark.parametrize("num_epochs", [None, 3])
def test_restored_state_continues_exactly(data_dir, name, num_epochs):
    config, split = STATE_CONFIGS[name]

    def loader():
        return td.make_loader(
            config,
            split=split,
            batch_size=8,
            seed=5,
            shuffle=True,
            num_epochs=num_epochs,
            data_dir=data_dir,
        )

    with loader() as first:
        reference = list(first) if num_epochs else take(first, 24)
    # A few batches in, then several epochs past the save point (the split is a few batches).
    for saved_at in (3, 7):
        with loader() as first:
            take(first, saved_at)
            state = json.loads(json.dumps(first.get_state()))  # as a checkpoint stores it
            assert len(json.dumps(state)) < 2000
        with loader() as second:
            second.set_state(state)
            rest = list(second) if num_epochs else take(second, 24 - saved_at)
        assert_same_batches(rest, reference[saved_at:])


def test_worker_processes_give_the_same_batches_and_resume(data_dir):
    def loader(num_workers):
        return td.make_loader(
            {"name": "digits", "num_workers": num_workers},
            split="test",
            batch_size=32,
            seed=1,
            shuffle=True,
            num_epochs=2,
            data_dir=data_dir,
        )

    with loader(0) as plain:
        reference = list(plain)
    with loader(2) as first:
        assert_same_batches(take(first, 3), reference[:3])
        state = json.loads(json.dumps(first.get_state()))
    with loader(2) as second:
        second.set_state(state)
        assert_same_batches(list(second), reference[3:])


def test_text_worker_processes_cover_the_epoch(data_dir):
    def loader(num_workers):
        config = {"name": "pydoc", "packing": False, "long_examples": "truncate", "seq_len": 512}
        return td.make_loader(
            {**config, "num_workers": num_workers},
            split="test",
            batch_size=16,
            seed=1,
            shuffle=True,
            num_epochs=1,
            data_dir=data_dir,
        )

    def examples(batches):
        return collections.Counter(r.tobytes() for b in batches for r in b["tokens"] if r.any())

    with loader(0) as plain:
        everything = examples(list(plain))
    with loader(2) as workers:
        # Text batches are built per worker from every k-th example: other batches, the same
        # examples, as many batches as announced.
        batches = list(workers)
        assert len(batches) == workers.num_batches
    assert examples(batches) == everything


def test_element_spec_matches_batches(data_dir):
    for config in ({"name": "digits", "image_size": 16}, {"name": "pydoc", "task": "mlm"}):
        with td.make_loader(
            config,
            split="test",
            batch_size=4,
            seed=0,
            shuffle=False,
            num_epochs=1,
            data_dir=data_dir,
        ) as loader:
            batch = next(loader)
        assert batch.keys() == loader.element_spec.keys()
        for k, spec in loader.element_spec.items():
            assert (batch[k].shape, batch[k].dtype) == (spec.shape, spec.dtype), k
        assert loader.element_spec == td.element_spec(config, 4)


# ------------------------------------------------------------------------------------ bad input
def make(config, data_dir, split="train", **kwargs):
    args = dict(split=split, batch_size=4, seed=0, shuffle=False, num_epochs=1, data_dir=data_dir)
    return td.make_loader(config, **{**args, **kwargs})


def test_unknown_dataset_and_fields(data_dir):
    with pytest.raises(ValueError, match="unknown dataset 'digitz'.*known datasets: digits"):
        make({"name": "digitz"}, data_dir)
    with pytest.raises(ValueError, match="'digits' has no config field 'seq_len'"):
        make({"name": "digits", "seq_len": 8}, data_dir)
    with pytest.raises(ValueError, match="field 'image_size' must be int"):
        make({"name": "digits", "image_size": "8"}, data_dir)
    with pytest.raises(ValueError, match="task='translation' is not available.*'lm', 'mlm'"):
        make({"name": "pydoc", "task": "translation"}, data_dir)


def test_unknown_and_empty_split(data_dir):
    with pytest.raises(
        ValueError, match=r"'digits' has no split 'validation'.*\['train', 'test'\]"
    ):
        make({"name": "digits"}, data_dir, split="validation")
    with pytest.raises(ValueError, match="split 'train\\[:0\\]' of dataset 'digits' is empty"):
        make({"name": "digits"}, data_dir, split="train[:0]")


def test_missing_and_unprepared_data(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data directory .*nowhere for dataset 'pydoc'"):
        make({"name": "pydoc"}, tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"'pydoc' is not prepared in .*tfjax.data.prepare"):
        make({"name": "pydoc"}, tmp_path)


def test_advice_for_a_damaged_dataset_folder_rebuilds_it(data_dir, tmp_path):
    shutil.copytree(f"{data_dir}/digits", tmp_path / "digits")
    (version,) = os.listdir(tmp_path / "digits")
    folder = tmp_path / "digits" / version
    os.remove(folder / "dataset_info.json")
    kept = sorted(os.listdir(folder))
    with pytest.raises(FileNotFoundError, match=f"'digits' in {folder} is damaged") as error:
        td.open_source("digits", "train", tmp_path)
    command = re.search(r"run `(.*?)`", str(error.value)).group(1)  # the advice, as given
    assert command.startswith("python -c ")
    subprocess.run([sys.executable, *shlex.split(command)[1:]], check=True, timeout=300)
    assert len(td.open_source("digits", "train", tmp_path)) == 1498
    assert sorted(os.listdir(f"{folder}.damaged-1")) == kept  # moved aside, not deleted


def test_sequence_length_must_hold_a_token(data_dir):
    with pytest.raises(ValueError, match="seq_len=1 cannot hold one token.*seq_len >= 2"):
        make({"name": "pydoc", "seq_len": 1}, data_dir)
    with pytest.raises(ValueError, match="long_examples='split'.*must be 'truncate'"):
        make({"name": "numbers_translate", "long_examples": "split"}, data_dir)


def test_state_of_another_loader_is_refused(data_dir):
    with make({"name": "digits"}, data_dir, batch_size=4) as a:
        next(a)
        state = a.get_state()
    with make({"name": "digits"}, data_dir, batch_size=8) as b:
        with pytest.raises(ValueError, match="saved with batch_size=4.*has batch_size=8"):
            b.set_state(state)
    with make({"name": "digits", "image_size": 16}, data_dir) as c:
        with pytest.raises(ValueError, match="config.image_size=8.*config.image_size=16"):
            c.set_state(state)


def test_state_saved_with_the_old_classification_task_name_resumes(data_dir):
    # Checkpoints before the one task vocabulary stored config.task="image_classification".
    with make({"name": "digits"}, data_dir, batch_size=4) as a:
        next(a)
        state = {**a.get_state(), "config.task": "image_classification"}
        expected = next(a)
    with make({"name": "digits"}, data_dir, batch_size=4) as b:
        b.set_state(state)
        assert_same_batches([next(b)], [expected])


def test_a_run_config_resolves_its_dataset_for_its_task():
    import ml_collections

    config = ml_collections.ConfigDict({"task": "mlm", "dataset": {"name": "pydoc", "task": None}})
    spec = td.dataset_spec(config)
    assert (spec.task, spec.name, spec.mlm_probability) == ("mlm", "pydoc", 0.15)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seq_len = 64
    assert td.resolve_config(spec) is spec  # resolved once, read everywhere
    config.dataset.task = "lm"
    with pytest.raises(ValueError, match="dataset.task='lm' differs from task='mlm'"):
        td.dataset_spec(config)
    config = ml_collections.ConfigDict({"task": "classification", "dataset": {"name": "pydoc"}})
    with pytest.raises(ValueError, match="task='classification' is not available.*'lm', 'mlm'"):
        td.dataset_spec(config)
    assert td.resolve_config({"name": "digits"}).task == "classification"


def test_corrupt_record_names_the_dataset_and_keeps_the_files(data_dir, tmp_path):
    from array_record.python import array_record_module

    shutil.copytree(f"{data_dir}/pydoc", tmp_path / "pydoc")
    shard = glob.glob(f"{tmp_path}/pydoc/*/*test.array_record*")[0]
    n = len(td.open_source("pydoc", "test", data_dir))
    writer = array_record_module.ArrayRecordWriter(shard, "group_size:1")
    for _ in range(n):  # valid ArrayRecord, but the records are not examples
        writer.write(b"\xff not a serialized example \x00")
    writer.close()
    size = os.path.getsize(shard)
    with pytest.raises(ValueError, match=r"record \d+ of dataset 'pydoc' split 'test' is corrupt"):
        list(make({"name": "pydoc"}, tmp_path, split="test"))
    with open(shard, "r+b") as f:  # damage the file structure itself
        f.seek(size // 2)
        f.write(b"\x00" * 64)
    with pytest.raises(ValueError, match="'pydoc' split 'test' is corrupt.*prepare the dataset"):
        list(make({"name": "pydoc"}, tmp_path, split="test"))
    assert os.path.getsize(shard) == size  # nothing deleted or rewritten
