"""The shipped configs: every preset loads, every tiny preset trains, the command line rejects
bad overrides, and the embedded ViT experiment reaches its documented accuracy."""

import dataclasses
import glob
import importlib.util
import logging
import os
import subprocess

import jax
import ml_collections
import numpy as np
import pytest
from conftest import ROOT, plain_env, run_command, run_python

import tfjax.data
from tfjax.data import catalog
from tfjax.runner import checks, defaults, metrics, train

# The tiny presets' programs are those of other tests' runs (tests/runner/test_train.py's ViT,
# the README's translation run): whichever compiles them first leaves them in the cache.
pytestmark = pytest.mark.usefixtures("compilation_cache")

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
NAMES = [os.path.splitext(os.path.basename(p))[0] for p in CONFIGS]


def load(name, preset):
    return train.load_config(os.path.join(ROOT, "configs", f"{name}.py:{preset}"))


def config_module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_families():
    assert NAMES == ["finetune", "lm", "mlm", "translate", "vit"]


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_loads_locked_and_documented(name):
    module = config_module(name)
    assert f"python experiments/run.py --config=configs/{name}.py:" in module.__doc__
    assert "tiny" in module._PRESETS
    for preset in module._PRESETS:
        config = module.get_config(preset)
        assert config.is_locked
        with pytest.raises(AttributeError, match="batchsize"):
            config.batchsize = 3  # a misspelt field is an error naming it
        checks.check_config(config)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        module.get_config("huge")


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_names_a_model_variant_and_sets_only_what_differs(name):
    """Sizes have one source of truth, the model file's VARIANTS: a config field that repeats
    its variant's value would hide whether the preset applies."""
    module = config_module(name)
    for preset in module._PRESETS:
        config = module.get_config(preset)
        if name == "finetune" and config.model.variant is None:
            continue  # the sizes are the checkpoint's (config.init_from), set by none of them
        variant = defaults.model_module(config.model.name).VARIANTS[config.model.variant]
        repeated = {k: v for k, v in config.model.items() if k in variant and v == variant[k]}
        assert not repeated, (preset, config.model.variant, repeated)


# finetune's tiny preset starts from a checkpoint: tests/runner/test_finetune.py runs it.
@pytest.mark.parametrize("name", [n for n in NAMES if n != "finetune"])
def test_tiny_preset_trains_compiling_each_step_once(name, data_dir, tmp_path, caplog):
    config = load(name, "tiny")
    config.data_dir = data_dir
    if name == "vit":  # evaluate on the whole test split: 299 images, the last batch partial
        config.eval_steps = 0
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        result = train.train_and_evaluate(config, str(tmp_path))
    assert result["step"] == config.num_train_steps == 2
    rows = metrics.read_metrics(str(tmp_path))
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (2, "train"), (2, "eval")]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert os.path.exists(tmp_path / "config.json")
    assert os.listdir(tmp_path / "checkpoints") == ["2"]
    assert any(f.startswith("events") for f in os.listdir(tmp_path / "tensorboard"))
    # No recompilation after the first step, the last (zero-padded) batch included.
    compiled = [r.getMessage() for r in caplog.records if "Compiling jit(" in r.getMessage()]
    assert sum("jit(train_step)" in m for m in compiled) == 1
    assert sum("jit(eval_step)" in m for m in compiled) == 1


@pytest.mark.parametrize("name", NAMES)
def test_every_dataset_field_can_be_set_and_unset_ones_take_the_catalog_default(name):
    module = config_module(name)
    for preset in module._PRESETS:
        config = module.get_config(preset)
        given = {k: v for k, v in config.dataset.items() if v is not None}
        defaults = tfjax.data.default_dataset_config(config.dataset.name)
        # every field is settable, and an lm dataset's train_files etc. switch it to "files"
        serves_lm = "lm" in catalog.CATALOG[config.dataset.name]["tasks"]
        switch = set(catalog.FILES_FIELDS) if serves_lm else set()
        assert set(config.dataset) == set(defaults) | set(given) | switch
        resolved = tfjax.data.dataset_spec(config)
        assert dict(resolved) == dict(defaults) | given | {"task": config.task}
    config = load(name, "tiny")
    field, value = {
        "vit": ("image_size", 40),
        "translate": ("vocab_size", 500),
        "finetune": ("skip_bad_rows", True),
    }.get(name, ("tokenizer", "sentencepiece"))
    assert config.dataset[field] is None  # a field the preset leaves to the catalog
    config.dataset[field] = value  # settable although the config is locked
    assert tfjax.data.dataset_spec(config)[field] == value


@pytest.mark.parametrize(
    "override, message",
    [
        ({"batchsize": 3}, "has no field batchsize; did you mean batch_size?"),
        ({"batch_size": "abc"}, "--config.batch_size=abc: invalid literal for int"),
        ({"mesh.data": 2.5}, "--config.mesh.data=2.5"),
    ],
)
def test_command_line_rejects_bad_overrides(override, message, tmp_path):
    workdir = tmp_path / "run"
    cmd = run_command(workdir, tmp_path / "data", override)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not workdir.exists()


def test_vit_digits_reaches_97_percent(data_dir, tmp_path):
    """The embedded experiment of configs/vit.py, run as documented there: one device, and
    XLA's own optimisations (its 1500 steps run longer than they compile, unlike the suite's)."""
    workdir = str(tmp_path / "run")
    cmd = run_command(workdir, data_dir, {}, config=os.path.join(ROOT, "configs", "vit.py:digits"))
    proc = run_python(*cmd[1:], env=plain_env(XLA_FLAGS=""), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = metrics.read_metrics(workdir, "eval")[-1]
    assert last["step"] == 1500 and last["accuracy"] >= 0.97, last


@pytest.mark.parametrize("name", NAMES)
def test_every_field_of_every_preset_declares_what_it_allows(name):
    """Each field is checked before any work against what it allows, declared beside its
    definition: the shared sections' in tfjax.runner.defaults.ALLOWED, the model's by its
    family (tfjax.models.common.check_fields), the dataset's by the catalog (each field typed
    by its default, tfjax.data.catalog.ALLOWED). A field added without one fails here."""
    module = config_module(name)
    for preset in module._PRESETS:
        config = module.get_config(preset)
        for key, value in config.items():
            if key == "dataset":  # tests/data/test_data_catalog.py checks the catalog's table
                continue
            if key == "logical_axis_rules":  # a table of its own: tfjax.sharding.check_rules
                continue
            if key == "model":
                family = defaults.model_module(value.name).Model.__annotations__["return"]
                fields = {f.name for f in dataclasses.fields(family)}
                assert set(value) - set(defaults.MODEL) <= fields, (preset, set(value) - fields)
                continue
            if isinstance(value, ml_collections.ConfigDict):
                undeclared = set(value) - set(defaults.ALLOWED[key])
                assert not undeclared, (preset, key, undeclared)
            else:
                assert key in defaults.RUN, (preset, key)
