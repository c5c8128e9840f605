"""SIGKILL at random moments (issue 48): a LoRA fine-tune from a Hugging Face checkpoint and
`compile.py --save`, each killed at a moment drawn uniformly over an uninterrupted run of the same
command (start-up, loading and keeping the checkpoint, steps, saves, the end), then run again as
the user would: the rerun finishes, and what it leaves equals the uninterrupted result, whatever
the kill left behind (a half-written copy of the checkpoint's files, an unfinished checkpoint, an
unfinished save). Fine-tune: the final checkpoint's adapters and optimizer state bit for bit, the
same eval losses. Save: until the rerun, the directory is no save or a whole one (the runner's
check); the rerun's is whole, without temporaries, compiled for what the uninterrupted one was.

KILL_TRIALS=N sets the trials of each (1 by default: the suite's cost; issue 48's closing note
reports a run with KILL_TRIALS=10). KILL_SEED picks the moments."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import finetune_checkpoints as fc
import jax
import numpy as np
import pytest
from conftest import ROOT, RUN, read_checkpoint

from tfjax.runner import executables, metrics

TRIALS = int(os.environ.get("KILL_TRIALS", "1"))
SEED = int(os.environ.get("KILL_SEED", "0"))
FINETUNE = os.path.join(ROOT, "configs", "finetune.py")
COMPILE = os.path.join(ROOT, "experiments", "compile.py")
STEPS = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the llama checkpoint, train.jsonl, eval.jsonl)."""
    root = tmp_path_factory.mktemp("kill")
    return (
        fc.build("llama", root / "llama"),
        fc.write_jsonl(root / "train.jsonl", fc.task_rows("reverse", 96, 11)),
        fc.write_jsonl(root / "eval.jsonl", fc.task_rows("reverse", 16, 12)),
    )


def finetune_command(files, workdir):
    checkpoint, train, evaluation = files
    return [
        sys.executable,
        RUN,
        f"--config={FINETUNE}:lora,tiny",
        f"--workdir={workdir}",
        f"--config.init_from={checkpoint}",
        f"--config.dataset.train_files={train}",
        f"--config.dataset.eval_files={evaluation}",
        f"--config.num_train_steps={STEPS}",
        "--config.eval_every=3",
        "--config.checkpoint.every=2",
        "--config.decode.num_samples=0",
    ]


def timed(cmd, env) -> float:
    """Seconds `cmd` takes to the end; asserts it succeeds."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return time.perf_counter() - start


def killed_at(cmd, env, seconds: float) -> bool:
    """Runs `cmd`, SIGKILLs it after `seconds` unless it ended first; whether it was killed."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        proc.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def moments(duration: float, salt: int) -> list[float]:
    rng = random.Random(SEED * 1000 + salt)
    return [rng.uniform(0, duration) for _ in range(TRIALS)]


def eval_losses(workdir) -> list:
    return [(r["step"], r["loss"]) for r in metrics.read_metrics(str(workdir), "eval")]


def test_a_lora_finetune_killed_anywhere_reruns_to_the_same_result(files, runner_env, tmp_path):
    straight = tmp_path / "straight"
    duration = timed(finetune_command(files, straight), runner_env)
    want = read_checkpoint(straight, STEPS)
    for i, moment in enumerate(moments(duration, 1)):
        workdir = tmp_path / f"killed_{i}"
        killed = killed_at(finetune_command(files, workdir), runner_env, moment)
        proc = subprocess.run(
            finetune_command(files, workdir),
            cwd=ROOT,
            env=runner_env,
            capture_output=True,
            text=True,
        )
        what = f"trial {i}: killed at {moment:.1f}s of {duration:.1f}s ({killed=})"
        assert proc.returncode == 0, f"{what}\n{proc.stderr[-3000:]}"
        got = read_checkpoint(workdir, STEPS)
        for item in ("params", "state"):
            flat_want, flat_got = _flat(want[item]), _flat(got[item])
            assert flat_want.keys() == flat_got.keys() and len(flat_want) > 3, what
            for key, array in flat_want.items():
                assert array.tobytes() == flat_got[key].tobytes(), f"{what}: {item} {key}"
        assert eval_losses(workdir)[-1] == eval_losses(straight)[-1], what
        with open(os.path.join(workdir, "pretrained", "base.json")) as f:
            assert json.load(f)["content"], what  # the base's digest, for later resumes


def _flat(tree) -> dict:
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def test_a_save_killed_anywhere_is_no_save_until_the_rerun_finishes(tmp_path, runner_env):
    """compile.py --save killed part-way: its directory is either no save (the runner refuses
    it by name) or a whole one; the same command again writes a save the runner loads."""

    def save(directory):
        return [
            sys.executable,
            COMPILE,
            "--config=configs/lm.py:tiny",
            "--topology=cpu:1",
            "--steps=train,eval",
            f"--save={directory}",
        ]

    env = runner_env
    straight = tmp_path / "straight"
    duration = timed(save(straight), env)
    for i, moment in enumerate(moments(duration, 2)):
        directory = tmp_path / f"killed_{i}"
        what = f"trial {i}: killed at {moment:.1f}s of {duration:.1f}s"
        if killed_at(save(directory), env, moment) and os.path.exists(directory):
            try:  # what the runner's check makes of what the kill left
                manifest = executables.check_dir(str(directory))
            except executables.SavedExecutablesError as e:
                assert "manifest.json is missing" in str(e), f"{what}: {e}"
            else:
                assert set(manifest["steps"]) == {"init", "train", "eval"}, what
        proc = subprocess.run(save(directory), cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"{what}\n{proc.stderr[-3000:]}"
        assert not [n for n in os.listdir(directory) if n.endswith(executables.TMP)], what
        manifest = executables.check_dir(str(directory))
        want = executables.check_dir(str(straight))
        assert manifest["fields"] == want["fields"], what
        shutil.rmtree(directory)
