"""Executables saved for launch (tfjax.runner.executables): experiments/compile.py --save writes
the tiny LM's initialisation, train and eval steps compiled for 2 of this host's CPU devices, and
the runner (config.compiled_dir) runs them instead of compiling, from a new state and resumed:
the same losses as a fresh run, step for step, and none of the three programs compiled. A
changed config field, a changed version, another device count or other argument shapes are each
named in one line and the run compiles as usual; a damaged, missing or unfinished save is
refused before any work, naming the path; a save for a TPU slice (libtpu's compiler on this
host) is written and named as another target here."""

import dataclasses
import json
import logging
import os
import shutil

import jax
import pytest
from conftest import ROOT, plain_env, run_python, set_fields

from tfjax import sharding
from tfjax.runner import aot, executables, metrics, setup, train

# The fresh runs load what other tests (and each other) compiled.
pytestmark = pytest.mark.usefixtures("compilation_cache")

SPEC = "configs/lm.py:tiny"
STEPS = 3
DEVICES = 2
SPLITS = ("train", "eval")
COMPILED = ("Compiling jit(init_fn)", "Compiling jit(train_step)", "Compiling jit(eval_step)")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The directory compile.py --save wrote for the tiny LM on cpu:2, with JAX's compilation
    cache warm (a compile.py report of the same config filled it before): programs the cache
    gave back would save without their machine code, so a save compiles them anew
    (`executables.fresh_compiles`), and the tests below run what it wrote."""
    root = tmp_path_factory.mktemp("saved")
    directory = str(root / "lm-tiny.cpu-2")
    env = dict(
        plain_env(),
        JAX_COMPILATION_CACHE_DIR=str(root / "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    for save in ([], [f"--save={directory}"]):
        proc = run_python(
            "experiments/compile.py",
            f"--config={SPEC}",
            f"--config.num_train_steps={STEPS}",
            f"--topology=cpu:{DEVICES}",
            "--steps=train,eval",
            *save,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert os.listdir(root / "jax_cache")  # the report's programs were cached
    saved = "init.executable, train.executable, eval.executable, manifest.json"
    assert f"saved to {directory}: {saved}" in proc.stdout
    return directory


def config_of(data_dir, compiled_dir="", **overrides):
    config = train.load_config(os.path.join(ROOT, SPEC))
    config.data_dir = data_dir
    config.compiled_dir = compiled_dir
    config.update(num_train_steps=STEPS, log_every=1, eval_every=0, eval_steps=1)
    config.checkpoint.every = 0
    config.decode.num_samples = 0  # its generation program is compiled at eval, never saved
    return set_fields(config, overrides)


def run(config, workdir, caplog, stop_after_step=None):
    """({split: [(step, loss)]}, the log's text) of a run on the first DEVICES devices, with
    JAX logging each program it compiles."""
    caplog.clear()
    with caplog.at_level(logging.INFO), jax.log_compiles(True):
        train.train_and_evaluate(
            config, str(workdir), devices=jax.devices()[:DEVICES], stop_after_step=stop_after_step
        )
    return losses_of(workdir), caplog.text


def losses_of(workdir):
    return {s: [(r["step"], r["loss"]) for r in metrics.read_metrics(workdir, s)] for s in SPLITS}


@pytest.fixture(scope="module")
def fresh(data_dir, tmp_path_factory):
    """The losses of the run compiled at start-up."""
    workdir = tmp_path_factory.mktemp("fresh")
    train.train_and_evaluate(config_of(data_dir), str(workdir), devices=jax.devices()[:DEVICES])
    return losses_of(workdir)


def test_saved_steps_run_instead_of_compiling_with_the_same_losses(
    data_dir, saved, fresh, tmp_path, caplog
):
    """A new state, then (stopped after step 2, as a preempted job) a restored one: both run
    the saved programs, to the fresh run's losses."""
    config, workdir = config_of(data_dir, saved), tmp_path / "loaded"
    _, first = run(config, workdir, caplog, stop_after_step=STEPS - 1)
    losses, resumed = run(config, workdir, caplog)
    assert losses == fresh and len(losses["train"]) == STEPS and losses["eval"]
    for program in ("init", "train", "eval"):
        assert f"The {program} program: loaded from {saved}/{program}.executable" in first
    assert "Resumed from" in resumed and "The train program: loaded from" in resumed
    for compiled in COMPILED:  # JAX compiled none of them (a compiling run logs these: below)
        assert compiled not in first + resumed
    assert "compiling instead" not in first + resumed


def changed_version(saved, tmp_path) -> str:
    copy = str(tmp_path / "other-jax")
    shutil.copytree(saved, copy)
    path = os.path.join(copy, executables.MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    manifest["versions"]["jax"] = "0.0.1"
    with open(path, "w") as f:
        json.dump(manifest, f)
    return copy


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"optim.learning_rate": 0.004},
            "compiled for optim.learning_rate=0.002, this run has 0.004; compiling instead",
        ),
        ("jax", f"compiled for jax 0.0.1, this is {jax.__version__}; compiling instead"),
    ],
    ids=["config field", "version"],
)
def test_a_difference_is_named_and_the_run_compiles(
    data_dir, saved, fresh, tmp_path, caplog, change, message
):
    if change == "jax":
        directory, overrides = changed_version(saved, tmp_path), {}
    else:
        directory, overrides = saved, change
    losses, log = run(config_of(data_dir, directory, **overrides), tmp_path / "run", caplog)
    assert f"compiled_dir={directory}: {message}" in log
    assert "loaded from" not in log
    for compiled in COMPILED:
        assert compiled in log
    assert len(losses["train"]) == STEPS
    if not overrides:  # the same config, compiled here: the same losses
        assert losses == fresh


def planned(config, devices, **inputs):
    """The Experiment the runner would set up on `devices` (nothing compiled)."""
    plan = dataclasses.replace(setup.planned_inputs(config), **inputs)
    return setup.set_up(config, sharding.make_mesh(config.mesh, devices), inputs=plan)


def test_other_devices_or_argument_shapes_are_named(data_dir, saved, caplog, tmp_path):
    config = config_of(data_dir, saved)
    manifest = executables.check_dir(saved)
    assert executables.mismatch(manifest, planned(config, jax.devices()[:DEVICES])) is None
    one = planned(config, jax.devices()[:1])
    assert executables.mismatch(manifest, one) == "compiled for 2 x cpu, this run has 1 x cpu"
    # The same config, another tokenizer's vocabulary: the model built differs.
    exp = planned(config, jax.devices()[:DEVICES], vocab_size=1000)
    with caplog.at_level(logging.INFO):
        assert executables.use_saved(exp, saved) is exp
    assert (
        f'compiled_dir={saved}: compiled for built model.vocab_size="384", this run has "1024"; '
        "compiling instead"
    ) in caplog.text
    # Arguments that differ where nothing compared before does (a backstop): named too.
    copy = str(tmp_path / "save")
    shutil.copytree(saved, copy)
    embedding = "[0].params['embed']['embedding'] float32[{}, 32]"
    arguments = manifest["steps"]["train"]["arguments"]
    i = next(i for i, line in enumerate(arguments) if line.startswith(embedding.format(384)))
    arguments[i] = embedding.format(1)
    with open(os.path.join(copy, executables.MANIFEST), "w") as f:
        json.dump(manifest, f)
    caplog.clear()
    exp = planned(config, jax.devices()[:DEVICES])
    with caplog.at_level(logging.INFO):
        loaded = executables.use_saved(exp, copy)
    assert loaded.train_step is exp.train_step and loaded.eval_step is not exp.eval_step
    assert (
        f"compiled_dir={copy}: the train program was compiled for {embedding.format(1)}, this "
        f"run has {embedding.format(384)} P('tensor', 'fsdp'); compiling instead"
    ) in caplog.text


def damaged(saved, tmp_path, how) -> str:
    copy = str(tmp_path / "save")
    shutil.copytree(saved, copy)
    path = os.path.join(copy, "train.executable")
    if how == "altered":
        with open(path, "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(1000)
    elif how == "missing file":
        os.remove(path)
    elif how == "no manifest":
        os.remove(os.path.join(copy, executables.MANIFEST))
    elif how == "no directory":
        shutil.rmtree(copy)
    return copy


@pytest.mark.parametrize(
    "how, message",
    [
        ("altered", "train.executable is damaged"),
        ("truncated", "train.executable is damaged (1000 bytes"),
        ("missing file", "the train program's {dir}/train.executable cannot be read"),
        ("no manifest", "{dir}/manifest.json is missing"),
        ("no directory", "no such directory"),
    ],
)
def test_a_damaged_save_is_refused_before_any_work(data_dir, saved, tmp_path, how, message):
    directory = damaged(saved, tmp_path, how)
    workdir = tmp_path / "workdir"
    with pytest.raises(executables.SavedExecutablesError) as e:
        train.train_and_evaluate(config_of(data_dir, directory), str(workdir))
    assert f"config.compiled_dir={directory!r}" in str(e.value)
    assert message.format(dir=directory) in str(e.value)
    assert not workdir.exists()  # refused before the workdir was made


def test_save_refuses_a_directory_holding_other_files(tmp_path):
    target = tmp_path / "workdir"
    target.mkdir()
    (target / "metrics.jsonl").write_text("{}\n")
    proc = run_python(
        "experiments/compile.py", f"--config={SPEC}", "--topology=cpu:1", f"--save={target}"
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--save={target}: holds other files (metrics.jsonl)" in proc.stderr
    assert os.listdir(target) == ["metrics.jsonl"]  # nothing compiled, nothing lost


def test_saving_for_a_tpu_slice_writes_what_a_tpu_host_loads(data_dir, tmp_path, v5e):
    """libtpu's compiler on this host: the programs are serialized for v5e:2x2 with libtpu's
    version; this CPU host's runner names the other target and compiles instead."""
    config = config_of(data_dir)
    with config.unlocked():
        config.mesh.update(data=1, fsdp=2, tensor=2)
    directory = str(tmp_path / "v5e")
    report = aot.compile_experiment(config, v5e, steps=("train",), save_to=directory)
    assert report.fits and [os.path.basename(p) for p in report.saved] == [
        "init.executable",
        "train.executable",
        executables.MANIFEST,
    ]
    manifest = executables.check_dir(directory)
    assert manifest["target"]["platform"] == "tpu" and manifest["target"]["devices"] == 4
    assert manifest["versions"]["libtpu"] and set(manifest["steps"]) == {"init", "train"}
    here = planned(config, jax.devices()[:4])
    assert executables.mismatch(manifest, here) == (
        "compiled for 4 x TPU v5 lite, this run has 4 x cpu"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--topology=cpu:2x2"], "the host's CPU devices are named cpu:N"),
        (["--topology=cpu:1", "--steps=decode", "--save=/tmp/x"], "has nothing to save"),
    ],
)
def test_bad_input_is_refused_before_compiling(args, message):
    proc = run_python("experiments/compile.py", f"--config={SPEC}", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
