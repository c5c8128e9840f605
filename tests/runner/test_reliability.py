"""Runs that survive (issue 6): bit-exact resume after SIGKILL, crash-safe saves and deletions,
failed asynchronous saves, SIGTERM/SIGINT, non-finite losses, recorded versions, no pickle.

Real subprocesses, real signals, real files. The runner runs `experiments/run.py` on the tiny
ViT config (8 simulated CPU devices, inherited from conftest's XLA_FLAGS); kills "right after
a checkpoint" are made exact by a wrapper that SIGKILLs its own process once that save is on
disk, so the test does not depend on timing.
"""

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import (
    ROOT,
    VIT_TINY,
    free_port,
    listed_steps,
    read_checkpoint,
    run_command,
    set_fields,
    start_process,
    wait_for_steps,
    xla_flags,
)

from tfjax.runner import checkpoint, checks, evaluation, metrics, setup, train
from tfjax.runner.checkpoint import data_position, metadata

# Runs in this process that compile what an earlier one compiled (the same config, another
# fault) load the programs from the compilation cache.
pytestmark = pytest.mark.usefixtures("compilation_cache")

# Runs experiments/run.py after replacing the save that the loop's save_train_state calls with one
# that SIGKILLs this process as soon as the save of step $KILL_AFTER_SAVE is complete on disk.
KILL_AFTER_SAVE = textwrap.dedent("""
    import os, runpy, signal, sys
    from tfjax.runner.checkpoint import train_state
    kill_after, original = int(os.environ["KILL_AFTER_SAVE"]), train_state.save
    def save(manager, step, **kwargs):
        original(manager, step, **kwargs)
        if step == kill_after:
            manager.wait_until_finished()
            os.kill(os.getpid(), signal.SIGKILL)
    train_state.save = save
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def vit_config(data_dir, **overrides):
    config = train.load_config(VIT_TINY)
    config.data_dir = data_dir
    return set_fields(config, overrides)


def run(cmd, env, timeout=300, **extra_env):
    proc = subprocess.run(
        cmd, env=dict(env, **extra_env), capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout + proc.stderr


def assert_bitwise_equal(a, b):
    paths_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    paths_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
    assert tree_a == tree_b
    assert len(paths_a) > 3
    for (path, x), (_, y) in zip(paths_a, paths_b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


def ckpt_config(async_save):
    fields = dict(every=1, keep=2, best_metric="", best_mode="max", replica_parallel=False)
    return ml_collections.ConfigDict(dict(fields, async_save=async_save))


# ------------------------------------------------------------------ 1. bit-exact resume
# An epoch of digits is 1498 images: 11.7 steps of 128. Gradient accumulation in 2 parts.
EXACT = {
    "batch_size": 128,
    "num_microbatches": 2,
    "num_train_steps": 16,
    "log_every": 1,
    "eval_every": 8,
    "checkpoint.every": 4,
    "checkpoint.keep": 10,
    "checkpoint.best_metric": "",
    "model.dropout_rate": 0.1,
}


@pytest.fixture(scope="module")
def straight_run(data_dir, runner_env, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("straight"))
    rc, out = run(
        run_command(workdir, data_dir, {**EXACT, "checkpoint.async_save": True}), runner_env
    )
    assert rc == 0, out[-3000:]
    return workdir


@pytest.mark.parametrize(
    "async_save, kill_after",
    [(True, 8), (False, 12)],  # mid-epoch 1 (resume crosses the boundary); just after it
    ids=["async-mid-epoch", "sync-after-epoch-boundary"],
)
def test_resume_after_sigkill_is_bit_exact(
    straight_run, data_dir, runner_env, tmp_path, async_save, kill_after
):
    workdir = str(tmp_path / "run")
    cmd = run_command(workdir, data_dir, {**EXACT, "checkpoint.async_save": async_save})
    rc, out = run(
        [sys.executable, "-c", KILL_AFTER_SAVE, *cmd[1:]],
        runner_env,
        KILL_AFTER_SAVE=str(kill_after),
    )
    assert rc == -signal.SIGKILL, out[-3000:]
    assert max(listed_steps(workdir)) == kill_after
    rc, out = run(cmd, runner_env)  # the same command again
    assert rc == 0, out[-3000:]
    assert f"Resumed from {workdir}/checkpoints/{kill_after}" in out

    for split in ("train", "eval"):  # every step's loss and accuracy, bit for bit
        got = [(r["step"], r["loss"], r["accuracy"]) for r in metrics.read_metrics(workdir, split)]
        want = [
            (r["step"], r["loss"], r["accuracy"]) for r in metrics.read_metrics(straight_run, split)
        ]
        assert got == want and len(want) >= 2
    a, b = read_checkpoint(straight_run, 16), read_checkpoint(workdir, 16)
    assert_bitwise_equal(a["params"], b["params"])
    assert_bitwise_equal(a["state"], b["state"])  # step, optimizer state, rng, skip counters
    assert a["data"] == b["data"] and b["data"]  # the same position in the same example order
    assert {"opt_state", "rng", "step"} <= set(b["state"])


# --------------------------------------------------- 2. a crash never loses the last checkpoint
SAVE_LOOP = textwrap.dedent("""
    import sys, jax.numpy as jnp, ml_collections
    from tfjax.runner import checkpoint
    directory, async_save = sys.argv[1], sys.argv[2] == "1"
    config = ml_collections.ConfigDict(dict(every=1, keep=2, best_metric="", best_mode="max",
                                            async_save=async_save, replica_parallel=False))
    manager = checkpoint.make_manager(directory, config)
    start = (manager.latest_step() or 0) + 1
    for step in range(start, start + 1000):
        # Values tell the step: a restored checkpoint is checked against its name.
        params = {"w": jnp.full((512, 1024), step, jnp.float32), "b": jnp.arange(step + 1.0)}
        checkpoint.save(manager, step, params=params, state={"step": jnp.int32(step)},
                        data_state={"position": step})
        if step == start:
            # The first step is on disk before any kill: a kill can only land in later saves
            # and deletions (an async first save killed early would leave no step at all).
            checkpoint.wait_until_finished(manager)
            print("ready", flush=True)
""")


def _check_checkpoints(directory):
    """Every listed step is complete: it restores, with the values its name says."""
    manager = checkpoint.make_manager(directory, read_only=True)
    steps = manager.all_steps()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for step in steps:

        def target(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=device)

        restored = checkpoint.restore(
            manager,
            step,
            abstract_state={"step": target((), jnp.int32)},
            abstract_params={
                "w": target((512, 1024), jnp.float32),
                "b": target((step + 1,), jnp.float32),
            },
        )
        np.testing.assert_array_equal(restored["params"]["w"], np.full((512, 1024), step))
        assert restored["params"]["b"].shape == (step + 1,)
        assert int(restored["state"]["step"]) == step
        assert restored["data"] == {"position": step}
    manager.close()
    return steps


def test_sigkill_during_saves_and_deletions_never_lists_a_partial_checkpoint(runner_env, tmp_path):
    rng = random.Random(0)
    interrupted = 0  # trials that left a half-written or half-deleted step behind
    for trial in range(8):
        directory = str(tmp_path / f"trial{trial}")
        async_save = trial % 2 == 0
        with subprocess.Popen(
            [sys.executable, "-c", SAVE_LOOP, directory, str(int(async_save))],
            env=runner_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        ) as proc:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.05, 1.5))
            proc.send_signal(signal.SIGKILL)
        names = os.listdir(directory)
        trash = os.path.join(directory, checkpoint.TRASH)
        interrupted += any("tmp" in n for n in names) or bool(
            os.path.isdir(trash) and os.listdir(trash)
        )
        steps = _check_checkpoints(directory)  # before any clean-up
        assert steps and len(steps) <= 3, (trial, names)
        # The run restarts: leftovers go, the step that was being written saves and restores.
        manager = checkpoint.make_manager(directory, ckpt_config(async_save))
        step = manager.latest_step() + 1
        params = {"w": jnp.full((512, 1024), step, jnp.float32), "b": jnp.arange(step + 1.0)}
        checkpoint.save(
            manager,
            step,
            params=params,
            state={"step": jnp.int32(step)},
            data_state={"position": step},
        )
        manager.wait_until_finished()
        manager.close()
        assert not [n for n in os.listdir(directory) if "tmp" in n]
        assert max(_check_checkpoints(directory)) == step
    print(f"{interrupted} of 8 kills left a partial step behind")
    assert interrupted >= 2  # the kills did land inside saves or deletions


# ------------------------------------------------------------ 3. a failed asynchronous save
def test_failed_async_save_is_never_latest_and_the_rerun_resumes(
    data_dir, tmp_path, monkeypatch, caplog
):
    workdir = str(tmp_path / "run")
    config = vit_config(
        data_dir,
        num_train_steps=12,
        log_every=3,
        eval_every=0,
        **{"checkpoint.every": 3, "checkpoint.async_save": True, "checkpoint.best_metric": ""},
    )
    original = data_position._data_file

    def failing(directory):  # the background write of step 6's data position fails
        if f"{os.sep}6.orbax-checkpoint-tmp" in str(directory):
            raise OSError(28, "No space left on device (injected)")
        return original(directory)

    monkeypatch.setattr(data_position, "_data_file", failing)
    stopped = r"checkpoint step 6 could not be written .* no space left"
    with pytest.raises(checkpoint.CheckpointWriteError, match=stopped):
        train.train_and_evaluate(config, workdir)
    # It surfaced at the next save (step 9), which therefore never started.
    assert listed_steps(workdir) == [3]
    assert [r["step"] for r in metrics.read_metrics(workdir, "train")] == [3, 6, 9]
    monkeypatch.setattr(data_position, "_data_file", original)
    with caplog.at_level("INFO"):
        result = train.train_and_evaluate(config, workdir)  # the same command again
    assert f"Resumed from {workdir}/checkpoints/3" in caplog.text
    assert result["step"] == 12 and max(listed_steps(workdir)) == 12
    assert [r["step"] for r in metrics.read_metrics(workdir, "train")] == [3, 6, 9, 12]


def test_a_save_that_raises_after_starting_its_writes_fails_at_once(
    data_dir, tmp_path, monkeypatch
):
    """An error inside Orbax's manager.save after it started the background writes (issue 38:
    a best_metric missing from the eval metrics) waited for those writes, whose checksums item
    waited for the save itself, until checkpoint.timeout_s; a SIGTERM meanwhile went unread,
    and the TimeoutError hid the error. Now the error comes at once, with a real SIGTERM
    received meanwhile, and the step's writes end: a complete step."""
    workdir = str(tmp_path / "run")
    config = vit_config(  # the programs of the test above, from the compilation cache
        data_dir,
        num_train_steps=12,
        log_every=3,
        eval_every=0,
        **{"checkpoint.every": 3, "checkpoint.timeout_s": 60, "checkpoint.best_metric": ""},
    )
    original, raised = ocp.CheckpointManager._get_old_steps_to_remove, []

    def failing(manager):  # inside manager.save, once step 6's writes started
        if manager.latest_step() == 6:
            raised.append(time.perf_counter())
            os.kill(os.getpid(), signal.SIGTERM)
            raise KeyError("injected")
        return original(manager)

    monkeypatch.setattr(ocp.CheckpointManager, "_get_old_steps_to_remove", failing)
    with pytest.raises(KeyError, match="injected"):
        train.train_and_evaluate(config, workdir)
    assert time.perf_counter() - raised[0] < 10  # checkpoint.timeout_s is 60
    assert listed_steps(workdir) == [3, 6]  # its writes ended: nothing is lost
    saved = read_checkpoint(workdir, 6)
    assert int(saved["state"]["step"]) == 6 and saved["data"]
    assert os.path.exists(os.path.join(workdir, "checkpoints", "6", "checksums", "checksums.json"))


# ---------------------------------------------------------------- 4. SIGTERM and SIGINT
LONG = {
    "num_train_steps": 100000,
    "log_every": 1,
    "eval_every": 0,
    "checkpoint.every": 0,
    "checkpoint.best_metric": "",
}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_finishes_the_step_saves_and_exits(data_dir, runner_env, tmp_path, sig):
    workdir = str(tmp_path / "run")
    cmd = run_command(workdir, data_dir, LONG)
    with subprocess.Popen(
        cmd, env=runner_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        wait_for_steps(workdir, 3, proc)
        proc.send_signal(sig)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + sig, out[-3000:]
    name = signal.Signals(sig).name
    line = [x for x in out.splitlines() if x.startswith(f"Stopped by {name} at step ")]
    assert line, out[-3000:]
    step = int(line[0].split()[5])
    assert "Run the same command again to resume." in line[0]
    assert 3 <= step < 100000
    assert listed_steps(workdir) == [step]  # checkpoint.every=0: only the one of the signal
    assert metrics.read_metrics(workdir, "train")[-1]["step"] == step  # the step was finished
    state = read_checkpoint(workdir, step)
    assert int(state["state"]["step"]) == step and state["data"]


def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(
    data_dir, runner_env, tmp_path
):
    """Two local processes (jax.distributed, gloo): JAX's preemption service, reached by every
    process each step, makes both save the same step and stop."""
    workdir = str(tmp_path / "run")
    cmd = [
        *run_command(workdir, data_dir, LONG),
        f"--coordinator_address=127.0.0.1:{free_port()}",
        "--num_processes=2",
    ]
    env = dict(runner_env, XLA_FLAGS=xla_flags(devices=4))
    procs = [start_process(cmd, i, env) for i in range(2)]
    try:
        wait_for_steps(workdir, 3, procs[0])
        procs[1].send_signal(signal.SIGTERM)  # one process only
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    stopped = []
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
        line = [x for x in out.splitlines() if x.startswith("Stopped by ")]
        assert line, out[-3000:]
        stopped.append(int(line[0].split(" at step ")[1].split()[0]))
    # SIGTERM is the preemption service's (a C++ handler): neither process names the signal.
    assert all("Stopped by preemption" in out for out in outputs)
    step = stopped[0]
    assert stopped == [step, step] and 3 <= step < 100000
    assert listed_steps(workdir) == [step]
    data = os.listdir(os.path.join(workdir, "checkpoints", str(step), "data"))
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data)


def test_signal_during_eval_or_set_up_stops_with_a_checkpoint(data_dir, tmp_path, monkeypatch):
    previous = signal.getsignal(signal.SIGTERM)
    config = vit_config(
        data_dir,
        num_train_steps=6,
        log_every=5,
        eval_every=3,
        **{"checkpoint.every": 0, "checkpoint.best_metric": ""},
    )
    evaluate = evaluation.evaluate_split

    def evaluate_and_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, while evaluating
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_split", evaluate_and_signal)
    workdir = str(tmp_path / "eval")
    result = train.train_and_evaluate(config, workdir)
    assert result["stopped_by"] == "SIGTERM" and result["step"] == 3
    assert listed_steps(workdir) == [3]
    assert [r["step"] for r in metrics.read_metrics(workdir, "eval")] == [3]  # eval finished
    assert signal.getsignal(signal.SIGTERM) == previous  # the handler is put back
    monkeypatch.setattr(evaluation, "evaluate_split", evaluate)

    make_manager = checkpoint.make_manager

    def make_manager_and_signal(*args, **kwargs):  # during set-up, before the first step
        os.kill(os.getpid(), signal.SIGINT)
        return make_manager(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "make_manager", make_manager_and_signal)
    workdir = str(tmp_path / "setup")
    result = train.train_and_evaluate(config, workdir)
    monkeypatch.setattr(checkpoint, "make_manager", make_manager)
    assert result["stopped_by"] == "SIGINT" and result["step"] == 1
    assert listed_steps(workdir) == [1]
    # The step that ran is logged although log_every=5 (the plot needs it, too).
    assert [r["step"] for r in metrics.read_metrics(workdir, "train")] == [1]
    result = train.train_and_evaluate(config.copy_and_resolve_references(), workdir)
    assert result["stopped_by"] is None and result["step"] == 6  # resumes and finishes


# --------------------------------------------------------------- 5. non-finite values
def _poison(monkeypatch, bad_steps, value):
    """Makes the images of the (1-based) `bad_steps` all `value` inside the jitted step."""
    make_train_step = setup.make_train_step

    def make(*args, **kwargs):
        step_fn = make_train_step(*args, **kwargs)

        def poisoned(state, batch, rng):
            bad = jnp.isin(state.step + 1, jnp.asarray(bad_steps))
            image = jnp.where(bad, jnp.asarray(value, batch["image"].dtype), batch["image"])
            return step_fn(state, dict(batch, image=image), rng)

        return poisoned

    monkeypatch.setattr(setup, "make_train_step", make)


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_nonfinite_loss_stops_naming_the_step_without_saving_it(
    data_dir, tmp_path, monkeypatch, value
):
    _poison(monkeypatch, [5], value)
    workdir = str(tmp_path / "run")
    config = vit_config(
        data_dir,
        num_train_steps=12,
        log_every=4,
        eval_every=0,
        **{"checkpoint.every": 2, "checkpoint.keep": 10, "checkpoint.best_metric": ""},
    )
    with pytest.raises(
        FloatingPointError,
        match=r"^step 5: non-finite loss or gradient .*"
        r"the newest checkpoint is step 4",
    ):
        train.train_and_evaluate(config, workdir)
    assert listed_steps(workdir) == [2, 4]  # the save at step 6 checked first, and stopped


def test_skip_mode_leaves_the_state_unchanged_and_counts(data_dir, tmp_path, monkeypatch):
    _poison(monkeypatch, [3], np.nan)
    workdir = str(tmp_path / "run")
    config = vit_config(
        data_dir,
        num_train_steps=4,
        log_every=2,
        eval_every=0,
        nonfinite="skip",
        max_nonfinite_skips=2,
        **{"checkpoint.every": 1, "checkpoint.keep": 10, "checkpoint.best_metric": ""},
    )
    result = train.train_and_evaluate(config, workdir)
    assert result["step"] == 4
    two, three, four = (read_checkpoint(workdir, s) for s in (2, 3, 4))
    assert_bitwise_equal(two["params"], three["params"])  # step 3's update was dropped
    assert_bitwise_equal(two["state"]["opt_state"], three["state"]["opt_state"])
    assert not np.array_equal(three["params"]["head"]["kernel"], four["params"]["head"]["kernel"])
    assert int(three["state"]["skipped"]) == 1 and int(three["state"]["skipped_in_a_row"]) == 1
    assert int(four["state"]["skipped"]) == 1 and int(four["state"]["skipped_in_a_row"]) == 0
    logged = metrics.read_metrics(workdir, "train")
    assert [(r["step"], r["skipped_updates"]) for r in logged] == [(2, 0.0), (4, 1.0)]
    assert all(np.isfinite(r["loss"]) for r in logged)  # the skipped step is not in the mean


def test_skip_mode_stops_after_too_many_skips_in_a_row(data_dir, tmp_path, monkeypatch):
    _poison(monkeypatch, [2, 3, 4], np.nan)
    config = vit_config(
        data_dir,
        num_train_steps=8,
        log_every=8,
        eval_every=0,
        nonfinite="skip",
        max_nonfinite_skips=2,
        **{"checkpoint.every": 0, "checkpoint.best_metric": ""},
    )
    with pytest.raises(
        FloatingPointError,
        match=r"^step 4: 3 updates in a row skipped .*"
        r"max_nonfinite_skips=2",
    ):
        train.train_and_evaluate(config, str(tmp_path / "run"))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("nonfinite", "ignore", "nonfinite must be one of ('error', 'skip'), got 'ignore'"),
        ("max_nonfinite_skips", 0, "max_nonfinite_skips must be an integer >= 1, got 0"),
    ],
)
def test_nonfinite_options_are_checked(field, value, message):
    config = train.load_config(VIT_TINY)
    config[field] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checks.check_config(config)


# ------------------------------------------------- 9. versions, 8. nothing is unpickled
def _tiny_checkpoint(directory):
    manager = checkpoint.make_manager(directory, ckpt_config(False))
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    checkpoint.save(
        manager, 1, params=params, state={"step": jnp.int32(1)}, data_state={"position": 1}
    )
    manager.close()
    return jax.eval_shape(lambda: params), {"step": jax.ShapeDtypeStruct((), jnp.int32)}


def test_versions_are_recorded_and_a_difference_warns_with_both(tmp_path, monkeypatch):
    directory = str(tmp_path / "checkpoints")
    abstract_params, abstract_state = _tiny_checkpoint(directory)
    with open(os.path.join(directory, "1", "_CHECKPOINT_METADATA")) as f:
        recorded = json.load(f)["custom_metadata"]["versions"]
    assert recorded == checkpoint.versions()
    assert set(recorded) == {"jax", "flax", "optax", "orbax-checkpoint", "tfjax"}
    assert recorded["jax"] == jax.__version__

    warnings = []
    monkeypatch.setattr(metadata.logging, "warning", lambda msg, *a: warnings.append(msg % a))
    manager = checkpoint.make_manager(directory, read_only=True)
    checkpoint.restore(manager, 1, abstract_params=abstract_params, abstract_state=abstract_state)
    assert not [w for w in warnings if "package versions" in w]
    monkeypatch.setattr(metadata, "versions", lambda: dict(recorded, jax="99.0"))
    checkpoint.restore(manager, 1, abstract_params=abstract_params, abstract_state=abstract_state)
    manager.close()
    [warning] = [w for w in warnings if "other package versions" in w]
    assert f"'jax': '{jax.__version__}'" in warning and "'jax': '99.0'" in warning


def test_checkpoints_and_tokenizers_load_without_unpickling(tmp_path, data_dir, monkeypatch):
    directory = str(tmp_path / "checkpoints")
    abstract_params, abstract_state = _tiny_checkpoint(directory)

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle was used")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    load = np.load
    monkeypatch.setattr(np, "load", lambda *a, **k: load(*a, **dict(k, allow_pickle=False)))
    manager = checkpoint.make_manager(directory, read_only=True)
    restored = checkpoint.restore(
        manager, 1, abstract_params=abstract_params, abstract_state=abstract_state
    )
    manager.close()
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(6.0).reshape(2, 3))
    assert restored["data"] == {"position": 1}
    import tfjax.data

    config = train.load_config(os.path.join(ROOT, "configs", "lm.py:tiny"))
    data_config = tfjax.data.dataset_spec(config)
    tfjax.data.prepare(data_config.name, data_dir)
    tokenizer = tfjax.data.get_tokenizer(data_config, data_dir)
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello"
