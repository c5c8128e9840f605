"""The README's quickstart `make train`, from a clean copy of the tracked files.

CI itself runs `make test` from a fresh clone (installing everything from nothing); this test
adds the other quickstart command on the tiny preset, with an empty data directory and no
compilation cache, reusing the already installed virtual environment (`make -o install`).
"""

import os
import shutil
import subprocess
import sys

from conftest import ROOT, own_info_lines

from tfjax.runner import host_memory


def _clean_copy(dest: str) -> None:
    if shutil.which("git") and os.path.isdir(os.path.join(ROOT, ".git")):
        files = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split("\0")
    else:  # an exported tree: everything but the local environment and outputs
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [
                d for d in dirnames if d not in ("workdirs", ".git") and not d.startswith(".venv")
            ]
            files += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames]
    for rel in filter(None, files):
        if os.path.exists(os.path.join(ROOT, rel)):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), os.path.join(dest, rel))


def test_make_train_from_a_clean_copy(tmp_path):
    # `make test` is the README's test command: make is there whenever the suite runs as asked.
    assert shutil.which("make"), "the quickstart's `make train` needs make on PATH"
    checkout = tmp_path / "tfjax"
    _clean_copy(str(checkout))
    assert not (checkout / "workdirs").exists() and not (checkout / ".venv").exists()
    # The installed environment at the checkout's .venv, as `make install` puts it: Orbax's
    # files are then under a folder named tfjax too.
    os.symlink(os.path.dirname(os.path.dirname(sys.executable)), checkout / ".venv")
    data_dir = tmp_path / "data"
    env = dict(os.environ, TFJAX_DATA_DIR=str(data_dir), JAX_COMPILATION_CACHE_DIR="", XLA_FLAGS="")
    env.pop("JAX_PLATFORMS", None)  # the runner chooses, as for a user who sets nothing
    # A user's shell, not the `make test` this suite may run under: make exports its
    # command-line variables (CI's PY=... VENV=.venv-newest) to the environment and MAKEFLAGS.
    for inherited in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PY", "VENV"):
        env.pop(inherited, None)
    command = ["make", "-o", "install", "train", "CONFIG=configs/vit.py:tiny"]

    first = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # No accelerator here: JAX starts its CPU backend only, not libtpu's or the CUDA plugin's
    # (installed, and each failing noisily). Orbax's INFO lines stay hidden.
    if not host_memory.accelerator_attached():
        assert "1 local devices of 1 (cpu)" in first.stderr
    for noise in ("Jax plugin configuration error", "TPU_WORKER_HOSTNAMES", "host bounds"):
        assert noise not in first.stderr, first.stderr[-3000:]
    assert any("Keep freed host memory" in line for line in own_info_lines(first.stderr))
    workdir = checkout / "workdirs" / "vit_tiny"  # the Makefile's default for this config
    # The closing report names the result and every output, and they exist.
    assert "Done: step 2; eval accuracy" in first.stdout, first.stdout
    for line in ("workdir", "checkpoints", "tensorboard", "curves"):
        assert f"  {line} " in first.stdout
    assert (workdir / "checkpoints" / "2").is_dir()
    assert (workdir / "plots" / "curves.png").stat().st_size > 10_000
    assert any((workdir / "tensorboard").iterdir())
    prepared = sorted(p.name for p in data_dir.iterdir())
    assert prepared, "the digits dataset was not prepared"
    stamp = {p: p.stat().st_mtime_ns for p in data_dir.rglob("*") if p.is_file()}

    # A second run reuses the prepared data and resumes at the last step instead of training.
    second = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Done: step 2" in second.stdout
    assert "step 1/2 train" not in second.stdout
    assert {p: p.stat().st_mtime_ns for p in data_dir.rglob("*") if p.is_file()} == stamp
