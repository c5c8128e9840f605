# ruff: noqa: F811 - pytest fixtures imported from test_reliability are test arguments
"""Runs that never silently corrupt (issue 22): the workdir lock, checkpoints verified on restore
with fallback, a full disk, TRASH, a changed config on resume.

Real files and real runs: the tiny ViT config of tests/runner/test_reliability.py, trained in this
process or through experiments/run.py; faults are made by writing into the saved files.
"""

import json
import logging
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, listed_steps, read_checkpoint, run_command
from test_reliability import assert_bitwise_equal, ckpt_config, run, vit_config

from tfjax.runner import checkpoint, train, workdirs
from tfjax.runner.checkpoint import data_position

# Runs in this process that compile what an earlier one compiled (the same config, another
# fault) load the programs from the compilation cache.
pytestmark = pytest.mark.usefixtures("compilation_cache")

SAVES = {
    "num_train_steps": 4,
    "eval_every": 0,
    "checkpoint.every": 2,
    "checkpoint.keep": 3,
    "checkpoint.best_metric": "",
}


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A tiny ViT run's workdir with checkpoints 2 and 4 (copy it before changing it)."""
    workdir = str(tmp_path_factory.mktemp("trained") / "run")
    train.train_and_evaluate(vit_config(data_dir, **SAVES), workdir)
    assert listed_steps(workdir) == [2, 4]
    return workdir


def _copy(workdir, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(workdir, out)
    return out


def _array_files(step_dir):
    """The files of a step's arrays (OCDBT data and b-tree files), largest first."""
    files = [
        os.path.join(d, f)
        for d, _, fs in os.walk(step_dir)
        for f in fs
        if os.sep + "d" + os.sep in os.path.join(d, f)
    ]
    return sorted(files, key=os.path.getsize, reverse=True)


# ------------------------------------------------------------------ 1. one run per workdir
def test_a_second_run_on_a_live_workdir_refuses_naming_the_owner(data_dir, runner_env, tmp_path):
    workdir = str(tmp_path / "run")
    with workdirs.claim(workdir):  # this process owns it, as a live run would
        with pytest.raises(workdirs.WorkdirBusyError, match=rf"pid {os.getpid()} on host"):
            train.train_and_evaluate(vit_config(data_dir, **SAVES), workdir)
        # The command line: one line naming the owner, status 1, nothing written.
        rc, out = run(run_command(workdir, data_dir, SAVES), runner_env)
        assert rc == 1, out[-2000:]
        [line] = [x for x in out.splitlines() if "WorkdirBusyError" in x]
        assert f"workdir {workdir} is in use by another run (pid {os.getpid()}" in line
        assert "Traceback" not in out
        assert sorted(os.listdir(workdir)) == [workdirs.LOCK_FILE]


def test_a_killed_owner_never_blocks_the_relaunch(data_dir, tmp_path, caplog):
    workdir = str(tmp_path / "run")
    script = textwrap.dedent(f"""
        import os, signal
        from tfjax.runner import workdirs
        with workdirs.claim({workdir!r}):
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)
    )
    assert proc.wait(timeout=120) == -signal.SIGKILL
    with open(os.path.join(workdir, workdirs.LOCK_FILE)) as f:
        assert json.load(f)["pid"] == proc.pid  # the killed owner's name is still there
    with caplog.at_level(logging.WARNING):
        result = train.train_and_evaluate(vit_config(data_dir, **SAVES), workdir)
    assert result["step"] == 4
    assert "did not end cleanly" in caplog.text
    with open(os.path.join(workdir, workdirs.LOCK_FILE)) as f:
        assert f.read() == ""  # a clean end empties it


def test_a_failed_start_leaves_no_folder_behind(tmp_path):
    workdir = str(tmp_path / "new")
    with pytest.raises(RuntimeError, match="set-up failed"):
        with workdirs.claim(workdir):
            os.makedirs(os.path.join(workdir, "checkpoints"))
            raise RuntimeError("set-up failed")
    assert not os.path.exists(workdir)
    os.makedirs(workdir)  # an existing workdir is never removed
    with pytest.raises(RuntimeError), workdirs.claim(workdir):
        raise RuntimeError("set-up failed")
    assert os.path.isdir(workdir)


# ----------------------------------------------------------- 2. checksums, 3. fallback
def _save_steps(directory) -> dict:
    """Steps 1 and 2 of a small checkpoint, whose values and data position tell their step; the
    abstract targets of `checkpoint.restore`."""
    manager = checkpoint.make_manager(directory, ckpt_config(False))
    for step in (1, 2):
        params = {"w": jnp.full((4, 3), float(step)), "b": jnp.arange(3.0) * step}
        checkpoint.save(
            manager,
            step,
            params=params,
            state={"step": jnp.int32(step)},
            data_state={"position": step},
        )
    manager.close()
    return dict(
        abstract_params=jax.eval_shape(lambda: params),
        abstract_state={"step": jax.ShapeDtypeStruct((), jnp.int32)},
    )


def test_values_changed_on_disk_are_refused_naming_the_array(tmp_path):
    directory = str(tmp_path / "checkpoints")
    abstract = _save_steps(directory)
    # Step 1's valid array files in place of step 2's: readable, but other values.
    shutil.rmtree(os.path.join(directory, "2", "params"))
    shutil.copytree(os.path.join(directory, "1", "params"), os.path.join(directory, "2", "params"))
    manager = checkpoint.make_manager(directory, read_only=True)
    changed = r"/2: the values of params/b \(and 1 more arrays\) differ"
    with pytest.raises(checkpoint.UnusableCheckpointError, match=changed):
        checkpoint.restore(manager, 2, **abstract)
    step, restored = checkpoint.restore_newest(manager, **abstract)
    manager.close()
    assert step == 1
    np.testing.assert_array_equal(restored["params"]["w"], np.ones((4, 3)))
    assert restored["data"] == {"position": 1}


DATA = os.path.join("data", "process_0-of-1.json")
CHECKSUMS = os.path.join("checksums", checkpoint.CHECKSUMS_FILE)
# Faults of step 2 of _save_steps: each is named and passed over, never restored as if intact.
ITEM_FAULTS = {
    "missing checksums/": (
        lambda d: shutil.rmtree(os.path.join(d, "checksums")),
        "2/checksums: missing (the step lacks its checksums)",
    ),
    "null checksums": (
        lambda d: _write(os.path.join(d, CHECKSUMS), b"null"),
        "checksums.json: damaged: it holds no checksum of params/b (nor of 2 more arrays)",
    ),
    "empty checksums": (
        lambda d: _write(os.path.join(d, CHECKSUMS), b"{}"),
        "checksums.json: damaged: it holds no checksum of params/b (nor of 2 more arrays)",
    ),
    "missing data position": (
        lambda d: os.remove(os.path.join(d, DATA)),
        "process_0-of-1.json: missing (this process's data position)",
    ),
    "data position of another step": (
        lambda d: shutil.copy(os.path.join(d, "..", "1", DATA), os.path.join(d, DATA)),
        "it is the data position of step 1, not of step 2 (copied from another step)",
    ),
}


def test_a_step_lacking_an_item_or_holding_another_steps_position_is_passed_over(tmp_path):
    saved = str(tmp_path / "saved")
    abstract = _save_steps(saved)
    for fault, (make, named) in ITEM_FAULTS.items():
        directory = str(tmp_path / fault.replace(" ", "_").replace("/", ""))
        shutil.copytree(saved, directory)
        damaged = os.path.join(directory, "2")
        make(damaged)
        before = _contents(damaged)
        manager = checkpoint.make_manager(directory, read_only=True)
        with pytest.raises(checkpoint.UnusableCheckpointError) as e:
            checkpoint.restore(manager, 2, **abstract)
        assert named in str(e.value) and str(e.value).startswith(damaged), fault
        step, restored = checkpoint.restore_newest(manager, **abstract)
        assert (step, restored["data"]) == (1, {"position": 1}), fault
        np.testing.assert_array_equal(restored["params"]["w"], np.ones((4, 3)))
        checkpoint.set_aside_after(manager, step)
        assert manager.all_steps() == [1]
        manager.close()
        aside = os.path.join(os.path.dirname(directory), checkpoint.UNUSABLE, "2")
        assert _contents(aside) == before, fault  # moved, files unchanged
        shutil.rmtree(os.path.dirname(aside))


def test_a_step_written_before_the_checksums_and_step_bound_positions_still_restores(
    tmp_path, caplog
):
    """A step as tfjax wrote it before (no FORMAT, no checksums item, a data position without
    its step) is old, not damaged: it restores, with a warning that nothing verifies it."""
    directory = str(tmp_path / "checkpoints")
    abstract = _save_steps(directory)
    step_dir = os.path.join(directory, "2")
    shutil.rmtree(os.path.join(step_dir, "checksums"))
    path = os.path.join(step_dir, "_CHECKPOINT_METADATA")
    with open(path) as f:
        metadata = json.load(f)
    del metadata["item_handlers"]["checksums"], metadata["custom_metadata"]["tfjax_format"]
    with open(path, "w") as f:
        json.dump(metadata, f)
    state = {"position": 2}
    with open(os.path.join(step_dir, DATA), "w") as f:
        json.dump({"sha256": data_position._digest(state), "state": state}, f)
    manager = checkpoint.make_manager(directory, read_only=True)
    with caplog.at_level(logging.WARNING):
        restored = checkpoint.restore(manager, 2, **abstract)
    manager.close()
    assert restored["data"] == state
    np.testing.assert_array_equal(restored["params"]["w"], np.full((4, 3), 2.0))
    assert "records no checksums" in caplog.text


def test_checksums_change_with_any_value_and_not_with_the_sharding():
    mesh = jax.make_mesh((8,), ("x",))
    x = jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8)
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    base = checkpoint.checksums({"x": x})
    assert checkpoint.checksums({"x": sharded}) == base
    for i, j in [(0, 0), (63, 7), (17, 3)]:
        assert checkpoint.checksums({"x": x.at[i, j].add(1e-3)}) != base
    swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])  # same values, other places
    assert checkpoint.checksums({"x": swapped}) != base
    for dtype in (jnp.bfloat16, jnp.int8, jnp.bool_, jnp.uint32):
        y = jnp.ones((5, 3), dtype)
        assert checkpoint.checksums({"y": y}) != checkpoint.checksums(
            {"y": y.at[4, 2].set(jnp.zeros((), dtype))}
        )


def test_random_bytes_never_restore_other_values(trained, data_dir, tmp_path):
    """The adversarial trial of the issue: 1,000 random bytes written into an array file of the
    newest step. Each trial restores the saved values exactly, or refuses the step and falls
    back to the older one; never other values."""
    saved = read_checkpoint(trained, 4)["params"]
    _, params, _ = train.restore_model(vit_config(data_dir, **SAVES), trained)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
    )
    refused = 0
    for seed in range(8):
        workdir = _copy(trained, tmp_path / str(seed))
        rng = random.Random(seed)
        files = _array_files(os.path.join(workdir, "checkpoints", "4", "params"))
        # Even seeds: the largest file (the arrays' data, always read); odd: any of them. Not a
        # choice by name: OCDBT names its files at random, so that choice changed from run to
        # run, and one full-suite run here hit only files a restore does not read.
        path = files[0] if seed % 2 == 0 else rng.choice(files)
        size = os.path.getsize(path)
        n = min(1000, size)
        with open(path, "r+b") as f:
            f.seek(rng.randrange(size - n + 1))
            f.write(bytes(rng.randrange(256) for _ in range(n)))
        try:
            restored = checkpoint.restore_params(workdir, abstract)
        except checkpoint.UnusableCheckpointError as e:
            assert "checkpoints/4" in str(e)
            refused += 1
            continue
        assert_bitwise_equal(jax.device_get(restored), saved)
    assert refused >= 1  # the data file's trials change bytes that are read


def _write(path, data: bytes, *, truncate_to=None):
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        if truncate_to is not None:
            f.truncate(truncate_to)
        else:
            f.truncate(0)
            f.write(data)


FAULTS = {
    "truncated": lambda d: _write(_array_files(d)[0], b"", truncate_to=100),
    "zeroed": lambda d: _write(_array_files(d)[0], bytes(os.path.getsize(_array_files(d)[0]))),
    "deleted": lambda d: os.remove(_array_files(d)[0]),
    "bad _METADATA": lambda d: _write(os.path.join(d, "params", "_METADATA"), b"{"),
    "bad data JSON": lambda d: _write(os.path.join(d, DATA), b"{bad"),
    "changed data position": lambda d: _change_data_position(d),
    "missing state/": lambda d: shutil.rmtree(os.path.join(d, "state")),
    # A step written with its data position is damaged without it, not old (issue 38).
    "missing data/": lambda d: shutil.rmtree(os.path.join(d, "data")),
    # Orbax does not list it, and the save of step 4 failed on it on every rerun (issue 38).
    "dangling symlink": lambda d: (shutil.rmtree(d), os.symlink("/nonexistent/4", d)),
}
NAMED = {
    "bad _METADATA": "params/_METADATA: not valid JSON",
    "bad data JSON": "process_0-of-1.json: not valid JSON",
    "changed data position": "process_0-of-1.json: its content does not match its SHA-256",
    "missing state/": "state: missing",
    "missing data/": "4/data: missing (the step lacks its data)",
    "dangling symlink": "4: a symbolic link to /nonexistent/4, which does not exist",
}


def _change_data_position(step_dir):
    path = os.path.join(step_dir, DATA)
    with open(path) as f:
        stored = json.load(f)
    stored["state"]["changed"] = 1  # a valid JSON file with another position
    with open(path, "w") as f:
        json.dump(stored, f)


def _contents(path):
    """{relative path: bytes} of the files under a directory; a symbolic link's target."""
    if os.path.islink(path):
        return os.readlink(path)
    return {
        os.path.relpath(os.path.join(d, f), path): pathlib.Path(d, f).read_bytes()
        for d, _, fs in os.walk(path)
        for f in fs
    }


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_unreadable_newest_step_is_named_set_aside_and_the_run_resumes(
    fault,
    trained,
    data_dir,
    tmp_path,
    caplog,
):
    workdir = _copy(trained, tmp_path)
    damaged = os.path.join(workdir, "checkpoints", "4")
    FAULTS[fault](damaged)
    before = _contents(damaged)
    with caplog.at_level(logging.WARNING):
        result = train.train_and_evaluate(
            vit_config(data_dir, **dict(SAVES, num_train_steps=6)), workdir
        )
    [error] = [r.getMessage() for r in caplog.records if "Checkpoint unusable" in r.getMessage()]
    assert f"{damaged}" in error and len(error) < 700
    assert NAMED.get(fault, "checkpoints/4") in error
    assert "Resuming from checkpoint" in caplog.text and "/checkpoints/2, the newest" in caplog.text
    assert result["step"] == 6 and listed_steps(workdir) == [2, 4, 6]  # 4 trained anew
    aside = os.path.join(workdir, checkpoint.UNUSABLE, "4")
    assert before and _contents(aside) == before  # its files unchanged


def test_with_no_usable_step_the_run_stops_listing_them_and_deletes_nothing(
    trained, data_dir, tmp_path
):
    workdir = _copy(trained, tmp_path)
    for step in ("2", "4"):
        FAULTS["bad _METADATA"](os.path.join(workdir, "checkpoints", step))
    with pytest.raises(checkpoint.UnusableCheckpointError) as e:
        train.train_and_evaluate(vit_config(data_dir, **SAVES), workdir)
    message = str(e.value)
    assert "no checkpoint in" in message and "nothing was deleted" in message
    assert (
        "checkpoints/4/params/_METADATA" in message and "checkpoints/2/params/_METADATA" in message
    )
    assert len(message.splitlines()) == 4
    listed = os.listdir(os.path.join(workdir, "checkpoints"))
    assert sorted(x for x in listed if x != checkpoint.TRASH) == ["2", "4"]


def test_restore_step_picks_a_step_once_and_sets_the_newer_ones_aside(trained, data_dir, tmp_path):
    workdir = _copy(trained, tmp_path)
    config = vit_config(data_dir, **dict(SAVES, num_train_steps=3))
    config.checkpoint.restore_step = 5
    missing = r"restore_step=5: .* has no such step \(it has \[2, 4\]\); set one of them"
    with pytest.raises(ValueError, match=missing):  # the pre-start check
        checkpoint.check_restore_step(config, workdir)
    with pytest.raises(ValueError, match=missing):  # the run makes the same check first
        train.train_and_evaluate(config, workdir)
    config.checkpoint.restore_step = 2
    result = train.train_and_evaluate(config, workdir)
    assert result["step"] == 3 and listed_steps(workdir) == [2, 3]
    assert os.listdir(os.path.join(workdir, checkpoint.UNUSABLE)) == ["4"]
    # The same command again (as after a stop) resumes from the newest step: restore_step took
    # effect once; it neither rolls the run back again nor sets more steps aside (issue 38).
    config.num_train_steps = 4
    checkpoint.check_restore_step(config, workdir)
    result = train.train_and_evaluate(config, workdir)
    assert result["step"] == 4 and listed_steps(workdir) == [2, 3, 4]
    assert os.listdir(os.path.join(workdir, checkpoint.UNUSABLE)) == ["4"]


def test_a_data_position_for_other_data_settings_is_one_line_and_moves_nothing(
    trained, data_dir, runner_env, tmp_path
):
    workdir = _copy(trained, tmp_path)
    before = _contents(os.path.join(workdir, "checkpoints"))
    rc, out = run(run_command(workdir, data_dir, dict(SAVES, batch_size=32)), runner_env)
    assert rc == 1, out[-3000:]
    [line] = [x for x in out.splitlines() if "CheckpointMismatchError" in x]
    assert f"checkpoint {workdir}/checkpoints/4: its data position does not fit" in line
    assert "saved with batch_size=16, but this loader has batch_size=32" in line
    assert "Traceback" not in out
    assert _contents(os.path.join(workdir, "checkpoints")) == before
    assert not os.path.exists(os.path.join(workdir, checkpoint.UNUSABLE))


READ_STEPS = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    from tfjax.runner import checkpoint
    f32 = jnp.float32
    manager = checkpoint.make_manager(sys.argv[1], read_only=True)
    try:
        checkpoint.restore_newest(
            manager,
            abstract_params={"w": jax.ShapeDtypeStruct((4, 3), f32),
                             "b": jax.ShapeDtypeStruct((3,), f32)},
            abstract_state={"step": jax.ShapeDtypeStruct((), jnp.int32)},
        )
    except checkpoint.CheckpointError as e:
        print(f"{type(e).__name__}: {e}")
""")


# As root: drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (linux/capability.h) from the
# bounding set (prctl PR_CAPBSET_DROP), then execs the rest of its command line: the program
# runs as root bound by file permissions like any user. A fresh process, not a preexec_fn: the
# test process runs JAX's threads, and fork with them is refused.
WITHOUT_ROOT_FILE_ACCESS = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in (1, 2):
    if libc.prctl(24, cap, 0, 0, 0) != 0:
        raise SystemExit(f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(ctypes.get_errno())}")
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def test_a_step_this_user_may_not_read_is_one_line_and_no_older_step_is_tried():
    """Not damage: the run must not pass it over (or move it) but say what to do. As root, the
    reader runs without the capabilities that let root past file permissions."""
    with tempfile.TemporaryDirectory() as base:
        os.chmod(base, 0o755)
        directory = os.path.join(base, "checkpoints")
        _save_steps(directory)
        step_dir = os.path.join(directory, "2")
        before = sorted(os.listdir(directory))
        as_user = ["-c", WITHOUT_ROOT_FILE_ACCESS] if os.geteuid() == 0 else []
        os.chmod(step_dir, 0)
        try:
            proc = subprocess.run(
                [sys.executable, *as_user, "-c", READ_STEPS, directory],
                cwd=ROOT,
                env=dict(os.environ, PYTHONPATH=ROOT, HOME=base),
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            os.chmod(step_dir, 0o755)
        assert sorted(os.listdir(directory)) == before
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("Checkpoint")] or [proc.stderr]
    assert line.startswith(f"CheckpointPermissionError: {step_dir}: permission denied"), line
    assert f"Permission denied: '{step_dir}/" in line and f"chmod -R u+rwX {step_dir}" in line
    assert "Checkpoint unusable" not in proc.stderr  # step 1 was not tried instead


# ---------------------------------------------------------------------------- 4. disk full
def test_a_full_disk_is_one_short_error_and_the_run_resumes(data_dir, runner_env, tmp_path):
    """A real small file system: a 1.2 MiB tmpfs mounted in a private mount namespace (root:
    unshare -m; otherwise a user namespace, unshare -rm) holds the workdir."""
    mount = tmp_path / "small"
    mount.mkdir()
    workdir = str(mount / "run")
    # The third checkpoint (step 6) fills the 1.2 MiB; 16 steps leave a margin.
    overrides = dict(SAVES, num_train_steps=16, **{"checkpoint.keep": 3})
    cmd = " ".join(f"'{c}'" for c in run_command(workdir, data_dir, overrides))
    script = textwrap.dedent(f"""
        mount -t tmpfs -o size=1200k tmpfs {mount} || exit 99
        {cmd} > {tmp_path}/full.out 2>&1; echo $? > {tmp_path}/full.rc
        cp -r {workdir} {tmp_path}/after_full
        mount -o remount,size=50m {mount}
        {cmd} > {tmp_path}/resume.out 2>&1; echo $? > {tmp_path}/resume.rc
    """)
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    proc = subprocess.run(
        [*unshare, "bash", "-c", script],
        env=runner_env,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"cannot mount a tmpfs here: {proc.stderr[-1000:]}"
    out = (tmp_path / "full.out").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "1", out[-3000:]
    [line] = [x for x in out.splitlines() if "CheckpointWriteError" in x]
    assert f"could not be written to {workdir}/checkpoints: no space left on the device" in line
    assert "is intact" in line and "MiB free of 1.2 MiB" in line
    assert "Traceback" not in out
    stored = listed_steps(str(tmp_path / "after_full"))
    assert stored and max(stored) < 16
    resumed = (tmp_path / "resume.out").read_text()
    assert (tmp_path / "resume.rc").read_text().strip() == "0", resumed[-3000:]
    assert f"Resumed from {workdir}/checkpoints/{max(stored)}" in resumed


# ------------------------------------------------------------------------------- 6. TRASH
def test_a_finished_run_keeps_keep_steps_and_an_empty_trash(data_dir, tmp_path):
    workdir = str(tmp_path / "run")
    every_step = {**SAVES, "num_train_steps": 6, "checkpoint.every": 1, "checkpoint.keep": 1}
    config = vit_config(data_dir, **every_step)
    train.train_and_evaluate(config, workdir)
    directory = os.path.join(workdir, "checkpoints")
    assert sorted(os.listdir(directory)) == ["6", "TRASH"]
    assert os.listdir(os.path.join(directory, checkpoint.TRASH)) == []


# ----------------------------------------------------------- 9. a changed config on resume
def test_a_changed_config_on_resume_is_logged_and_the_earlier_one_kept(
    trained, data_dir, tmp_path, caplog
):
    workdir = _copy(trained, tmp_path)
    with open(os.path.join(workdir, "config.json")) as f:
        earlier = f.read()
    config = vit_config(data_dir, **dict(SAVES, num_train_steps=5))
    config.optim.learning_rate = 0.5 * config.optim.learning_rate
    with caplog.at_level(logging.WARNING):
        train.train_and_evaluate(config, workdir)
    assert "Resuming" in caplog.text and "at step 4 with a changed config" in caplog.text
    assert "num_train_steps: 4 -> 5" in caplog.text and "optim.learning_rate: " in caplog.text
    with open(os.path.join(workdir, "config.4.json")) as f:
        assert f.read() == earlier
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["num_train_steps"] == 5
