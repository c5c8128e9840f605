"""Two local processes (coordinator on 127.0.0.1, gloo CPU collectives, 4 devices each) train
to the same losses as one process with 8 devices, and resume cooperatively from the
checkpoint they wrote together."""

import os
import shutil

import numpy as np
import pytest
from conftest import VIT_TINY, free_port, run_command, set_fields, start_process, xla_flags

from tfjax.runner import metrics, train

# A constant learning rate, so that stopping at step 3 and extending the run to 6 steps
# follows the same trajectory as 6 steps straight.
OVERRIDES = {
    "eval_every": 3,
    "checkpoint.every": 3,
    "optim.schedule": "constant",
    "optim.warmup_steps": 0,
    "optim.learning_rate": 0.01,
}


def run_two_processes(workdir, data_dir, runner_env, steps):
    """Both processes' outputs. With the runner's compilation cache: every launch here runs
    the same programs (the schedule is constant), so only the first compiles them."""
    env = dict(runner_env, XLA_FLAGS=xla_flags(devices=4))
    command = [
        *run_command(workdir, data_dir, {"num_train_steps": steps, **OVERRIDES}),
        f"--coordinator_address=127.0.0.1:{free_port()}",
        "--num_processes=2",
    ]
    procs = [start_process(command, i, env) for i in range(2)]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outputs


@pytest.fixture(scope="module")
def two_process_run(data_dir, runner_env, tmp_path_factory):
    """Two processes train 3 steps, then the same command with 6 steps resumes them: (the
    workdir, with checkpoints 3 and 6, and the outputs of the first and second launch)."""
    workdir = str(tmp_path_factory.mktemp("two") / "run")
    first = run_two_processes(workdir, data_dir, runner_env, steps=3)
    data = os.listdir(os.path.join(workdir, "checkpoints", "3", "data"))
    second = run_two_processes(workdir, data_dir, runner_env, steps=6)  # resumes from step 3
    return workdir, first, data, second


def test_two_processes_match_one_and_resume(data_dir, tmp_path, two_process_run):
    # The reference: this process, 8 devices, the same mesh (data=8), 6 steps straight.
    config = train.load_config(VIT_TINY)
    config.update(data_dir=data_dir, num_train_steps=6)
    set_fields(config, OVERRIDES)
    one = str(tmp_path / "one")
    train.train_and_evaluate(config, one)

    two, first, data, second = two_process_run
    assert "Process 1 of 2; 4 local devices of 8" in first[1]
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data)  # one position each
    assert "Resumed from" in second[0] and "/checkpoints/3" in second[0]

    for split in ("train", "eval"):
        a = [(r["step"], r["loss"]) for r in metrics.read_metrics(one, split)]
        b = [(r["step"], r["loss"]) for r in metrics.read_metrics(two, split)]
        assert [s for s, _ in b] == [s for s, _ in a] and len(a) >= 2
        np.testing.assert_allclose([v for _, v in b], [v for _, v in a], rtol=1e-5)


def test_a_step_one_process_cannot_read_is_given_up_by_both(
    data_dir, runner_env, tmp_path, two_process_run
):
    """Process 1's data position of the newest step is damaged: both processes fall back to the
    older step together (a step that fails on one process fails on all) and set it aside."""
    workdir = str(tmp_path / "two")
    shutil.copytree(two_process_run[0], workdir)  # checkpoints 3 and 6
    damaged = os.path.join(workdir, "checkpoints", "6", "data", "process_1-of-2.json")
    with open(damaged, "w") as f:
        f.write("{bad")
    outputs = run_two_processes(workdir, data_dir, runner_env, steps=7)
    assert f"{damaged}: not valid JSON" in outputs[1]
    assert "/checkpoints/6: process(es) [1] could not restore it" in outputs[0]
    for out in outputs:
        assert "Resumed from" in out and "/checkpoints/3" in out
    assert os.listdir(os.path.join(workdir, "checkpoints_set_aside")) == ["6"]
    assert "7" in os.listdir(os.path.join(workdir, "checkpoints"))
