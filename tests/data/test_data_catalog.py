"""Each catalog dataset's config builds batches of the right shapes from TFDS mock data (nothing
is downloaded), importing tfjax never pulls in TensorFlow, and loading a config never pulls in
TFDS or Grain."""

import dataclasses

import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import run_python

import tfjax.data as td
from tfjax.data import catalog, embedded

# The TFDS datasets: not the embedded ones, nor the user's own files and image folders.
CATALOG = [
    name
    for name in td.CATALOG
    if not (td.is_embedded(name) or td.is_files(name) or catalog.is_image_folders(name))
]


def test_the_issue_catalog_is_there():
    expected = {"mnist", "cifar10", "imagenet2012", "wmt14_translate/de-en", "lm1b", "glue/sst2"}
    assert set(CATALOG) == expected


def test_embedded_datasets_name_their_offline_builders():
    names = [name for name in td.CATALOG if td.is_embedded(name)]
    assert names == ["digits", "pydoc", "numbers_translate"]
    for name in names:
        assert issubclass(getattr(embedded, td.CATALOG[name]["embedded"]), tfds.core.DatasetBuilder)


@pytest.mark.parametrize("name", CATALOG)
def test_catalog_config_builds_batches_from_mock_data(name, tmp_path):
    config = td.default_dataset_config(name)
    if "seq_len" in config:  # smaller than the real settings: quick, same code path
        config.seq_len, config.vocab_size = 32, 300
    batch_size = 4
    with tfds.testing.mock_data(num_examples=10):
        for split, train in ((config.train_split, True), (config.eval_split, False)):
            with td.make_loader(
                config,
                split=split,
                batch_size=batch_size,
                seed=0,
                shuffle=train,
                num_epochs=1,
                data_dir=tmp_path,
            ) as loader:
                batches = list(loader)
            spec = loader.element_spec
            assert batches and (loader.num_batches in (None, len(batches)))
            for batch in batches:
                assert batch.keys() == spec.keys()
                for k, v in batch.items():
                    assert (v.shape, v.dtype) == (spec[k].shape, spec[k].dtype), k
    if "image" in spec:
        b, h, w, c = spec["image"].shape
        assert (b, h, w, c) == (
            batch_size,
            config.image_size,
            config.image_size,
            config.num_channels,
        )
        images = np.concatenate([b["image"] for b in batches])
        assert images.min() >= -1 and images.max() <= 1 and images.std() > 0.1
    if "label" in spec:
        labels = np.concatenate([b["label"] for b in batches])
        assert ((labels >= 0) & (labels < config.num_classes)).all()
    if "image" not in spec:
        vocab = loader.tokenizer.vocab_size
        assert isinstance(loader.tokenizer, td.SentencePieceTokenizer)  # trained on mock text
        for batch in batches:
            for key in ("tokens", "inputs", "targets"):
                if key in batch:
                    assert batch[key].max() < vocab and (batch[key] > 0).any()


def test_import_tfjax_does_not_import_tensorflow():
    code = (
        "import sys, tfjax\n"
        "import tfjax.models\n"
        "heavy = ('tensorflow', 'tensorflow_datasets', 'grain', 'sentencepiece')\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in heavy], 'tfjax'\n"
        "import tfjax.data\n"
        "assert 'tensorflow' not in sys.modules, 'tfjax.data imported TensorFlow'\n"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ["lm", "mlm", "translate", "vit"])
def test_loading_a_config_imports_neither_tfds_nor_grain(name):
    # In a fresh process: the other tests' imports would hide it here.
    code = (
        "import sys, importlib.util as u\n"
        f"s = u.spec_from_file_location('c', 'configs/{name}.py')\n"
        "m = u.module_from_spec(s); s.loader.exec_module(m); m.get_config('')\n"
        "heavy = ('tensorflow_datasets', 'tensorflow', 'grain')\n"
        "print([k for k in sys.modules if k.split('.')[0] in heavy])\n"
    )
    out = run_python("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_numeric_field_declares_its_range():
    """Each dataset field is typed by its default (resolve_config) and every number has its
    range in catalog.ALLOWED (seq_len's shortest row depends on the task: catalog._check), so
    a negative crop padding or a NaN probability is refused naming the field. A numeric field
    added without a range fails here."""
    numeric = [
        f.name
        for f in dataclasses.fields(catalog.DatasetSpec)
        if f.type in ("int | None", "float | None")
    ]
    assert numeric and not set(numeric) - set(catalog.ALLOWED) - {"seq_len"}
    for fields, message in [
        ({"name": "digits", "crop_padding": -1}, "crop_padding must be an integer >= 0, got -1"),
        ({"name": "pydoc", "task": "mlm", "mlm_probability": float("nan")}, "in \\(0, 1\\)"),
        ({"name": "digits", "num_classes": 5}, "num_classes=5 is fewer than the dataset's 10"),
    ]:
        with pytest.raises(ValueError, match=message):
            catalog.resolve_config(fields)
