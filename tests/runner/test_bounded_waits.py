"""Bounded waits (issue 6): a multi-process run whose peer never starts, freezes or dies mid-run
exits non-zero instead of hanging, naming the missing process where JAX can tell.

Real subprocesses and real signals: `experiments/run.py` on the tiny ViT config, two local
processes (coordinator on 127.0.0.1, gloo CPU collectives, 4 devices each). The time bounds are
generous "it did not hang" checks, not measurements.
"""

import re
import signal
import subprocess
import time

import pytest
from conftest import (
    free_port,
    listed_steps,
    read_checkpoint,
    run_command,
    start_process,
    wait_for_steps,
    xla_flags,
)

from tfjax.runner import checkpoint

TIMEOUT_S = 15  # --distributed_timeout and --heartbeat_timeout of these runs


@pytest.fixture(scope="session")
def env(runner_env):
    """Four devices per process (the runner's environment otherwise)."""
    return dict(runner_env, XLA_FLAGS=xla_flags(devices=4))


def two_process_command(workdir, data_dir, overrides):
    """run.py's command for two processes (without --process_id) and the coordinator address."""
    address = f"127.0.0.1:{free_port()}"
    cmd = [
        *run_command(workdir, data_dir, overrides),
        f"--coordinator_address={address}",
        "--num_processes=2",
        f"--distributed_timeout={TIMEOUT_S}",
        f"--heartbeat_timeout={TIMEOUT_S}",
    ]
    return cmd, address


def finish(proc, timeout):
    """(status, output, seconds) of a process, killed if it outlives `timeout` (a hang)."""
    begin = time.time()
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        pytest.fail(f"still running {timeout}s later (a hang):\n{out[-3000:]}")
    return proc.returncode, out, time.time() - begin


def test_a_process_that_never_starts_is_named_and_start_up_ends(data_dir, env, tmp_path):
    cmd, address = two_process_command(str(tmp_path / "run"), data_dir, {})
    proc = start_process(cmd, 0, env)  # process 1 of 2 is never started
    rc, out, seconds = finish(proc, TIMEOUT_S + 60)
    assert rc != 0, out[-3000:]
    assert (
        f"jax.distributed.initialize: not all 2 processes connected to {address} within "
        f"{TIMEOUT_S} s (--distributed_timeout)" in out
    ), out[-3000:]
    # JAX's error names the processes that did not connect: here process 1, and only it.
    assert re.search(r"Some timed out task names:\s*\n1\s*\n\s*\n", out), out[-3000:]
    assert seconds >= TIMEOUT_S - 1  # it did wait the configured time


def _run_until_step_5_then(signum, data_dir, env, tmp_path):
    """Two processes train; after step 5 process 1 gets `signum`. (workdir, status, output) of
    process 0, which must end on its own within the heartbeat timeout and a margin."""
    workdir = str(tmp_path / "run")
    overrides = {
        "num_train_steps": 100000,
        "log_every": 1,
        "eval_every": 0,
        "checkpoint.every": 2,
        "checkpoint.best_metric": "",
    }
    cmd, _ = two_process_command(workdir, data_dir, overrides)
    procs = [start_process(cmd, i, env) for i in range(2)]
    try:
        wait_for_steps(workdir, 5, procs[0])
        procs[1].send_signal(signum)
        rc, out, _ = finish(procs[0], TIMEOUT_S + 90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()  # closes its pipe
    return workdir, rc, out


# JAX's coordination service names the process that stopped sending heartbeats (here 1).
HEARTBEAT_NAMES_1 = r"tasks are unhealthy \(stopped sending heartbeats\):\s*\n1\s*\n"


def assert_newest_checkpoint_is_complete(workdir, out):
    """Whatever the failure interrupted, the newest listed checkpoint reads back, with both
    processes' data positions."""
    steps = listed_steps(workdir)
    assert steps, out[-3000:]
    newest = read_checkpoint(workdir, max(steps))
    assert int(newest["state"]["step"]) == max(steps)
    assert set(newest["data"]) == {"process_0-of-2.json", "process_1-of-2.json"}


def test_a_stalled_peer_is_named_and_the_survivor_exits(data_dir, env, tmp_path):
    # SIGSTOP: a frozen or cut-off host. Its connections stay open, so only the heartbeat check
    # can tell; it must name the process and end the survivor, not leave it in a collective.
    workdir, rc, out = _run_until_step_5_then(signal.SIGSTOP, data_dir, env, tmp_path)
    assert rc != 0, out[-3000:]
    assert re.search(HEARTBEAT_NAMES_1, out), out[-3000:]
    assert_newest_checkpoint_is_complete(workdir, out)


def test_a_killed_peer_ends_the_survivor(data_dir, env, tmp_path):
    # SIGKILL closes the dead process's sockets. Either the heartbeat check names it, or, when
    # the kill cuts a transfer of a collective short, gloo fails first (within a second) and
    # aborts the survivor with its own error, which names no process. Both end the run.
    workdir, rc, out = _run_until_step_5_then(signal.SIGKILL, data_dir, env, tmp_path)
    assert rc != 0, out[-3000:]
    assert re.search(HEARTBEAT_NAMES_1, out) or "gloo::" in out, out[-3000:]
    assert_newest_checkpoint_is_complete(workdir, out)


@pytest.mark.parametrize("value", [0, 2.5], ids=["zero", "float"])
def test_checkpoint_timeout_is_checked(tmp_path, value):
    import ml_collections

    config = ml_collections.ConfigDict(
        dict(
            every=1,
            keep=2,
            best_metric="",
            best_mode="max",
            async_save=True,
            replica_parallel=False,
            timeout_s=value,
        )
    )
    with pytest.raises(ValueError, match=r"checkpoint.timeout_s must be a whole number of seconds"):
        checkpoint.make_manager(str(tmp_path / "checkpoints"), config)
