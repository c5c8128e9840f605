"""A user's mistakes are refused before any work starts, in a few lines naming the field or flag,
the value and what is allowed: checks.check_config (values), checks.check_paths
(--workdir, data_dir, init_from) and experiments/run.py's command line (real subprocesses)."""

import os
import subprocess

import pytest
from conftest import ROOT, run_command, set_fields

from tfjax.runner import checks, setup


def tiny(name="vit", **overrides):
    return set_fields(
        setup.load_config(os.path.join(ROOT, "configs", f"{name}.py:tiny")), overrides
    )


# ------------------------------------------------------------------------------- check_config
@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("vit", {"optim.learning_rate": -1e-3}, r"optim.learning_rate must be >= 0, got -0.001"),
        (
            "vit",
            {"model.variant": "B/15"},
            r"model.variant='B/15' is unknown for "
            r"model.name='vit'; allowed: tiny/2, .*B/16",
        ),
        ("lm", {"model.variant": "gpt5"}, r"model.variant='gpt5' .* allowed: .*gpt2-small"),
        ("lm", {"model.name": "gpt"}, r"model.name='gpt': tfjax.models has no such model family"),
        ("lm", {"optim.schedule": "linear"}, r"optim.schedule='linear' is unknown"),
        ("lm", {"optim.name": "adam"}, r"optim.name='adam' is unknown"),
        ("lm", {"optim.warmup_steps": 2}, r"num_train_steps \(2\) > optim.warmup_steps \(2\)"),
        ("translate", {"optim.warmup_steps": 0}, r"'rsqrt' needs optim.warmup_steps >= 1"),
        ("mlm", {"optim.weight_decay": -0.01}, r"optim.weight_decay must be >= 0, got -0.01"),
        ("vit", {"optim.b2": 1.0}, r"optim.b2 must be in \[0, 1\), got 1.0"),
        ("vit", {"optim.grad_clip_norm": -1.0}, r"optim.grad_clip_norm must be >= 0"),
        ("vit", {"checkpoint.keep": 0}, r"checkpoint.keep must be >= 1, got 0"),
        ("vit", {"checkpoint.best_mode": "lowest"}, r"checkpoint.best_mode must be 'max' or"),
        ("vit", {"checkpoint.timeout_s": 0}, r"checkpoint.timeout_s must be a whole number"),
        ("lm", {"profile.num_steps": -1}, r"profile.num_steps must be >= 0, got -1"),
        (
            "vit",
            {"profile.start_step": 0, "profile.num_steps": 1},
            r"profile.start_step must be >= 1",
        ),
    ],
)
def test_check_config_refuses_invalid_values_naming_the_field(name, overrides, message):
    with pytest.raises(ValueError, match=message):
        checks.check_config(tiny(name, **overrides))


def test_check_config_allows_a_zero_rate_and_a_warmup_past_the_end_when_it_is_valid():
    checks.check_config(tiny(**{"optim.learning_rate": 0.0}))  # an eval-only run
    # constant: the peak is never reached, a valid (if odd) run
    config = tiny(**{"optim.schedule": "constant", "optim.warmup_steps": 5})
    checks.check_config(config)
    assert config.optim.warmup_steps > config.num_train_steps


# ------------------------------------------------------------------------------- check_paths
def test_check_paths_accepts_a_new_workdir_and_creates_nothing(tmp_path):
    checks.check_paths(tiny(data_dir=str(tmp_path / "data")), str(tmp_path / "a" / "b"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "workdir, data_dir, error, message",
    [
        ("file", "data", NotADirectoryError, r"--workdir='.*/file' is a file; a directory is"),
        (
            "file/run",
            "data",
            NotADirectoryError,
            r"--workdir='.*/file/run' cannot be created: .*/file is not a directory",
        ),
        ("", "data", ValueError, r"--workdir is empty"),
        ("run", "file", NotADirectoryError, r"config.data_dir='.*/file' is a file"),
        (
            "run",
            "file/x",
            NotADirectoryError,
            r"config.data_dir='.*/file/x' cannot be created: .*/file is not a directory",
        ),
    ],
)
def test_check_paths_refuses_a_file_naming_the_option_and_path(
    tmp_path, workdir, data_dir, error, message
):
    (tmp_path / "file").write_text("")
    workdir = workdir and str(tmp_path / workdir)
    with pytest.raises(error, match=message):
        checks.check_paths(tiny(data_dir=str(tmp_path / data_dir)), workdir)
    assert os.listdir(tmp_path) == ["file"]


def test_check_paths_checks_the_default_data_dir_naming_where_it_comes_from(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TFJAX_DATA_DIR", str(tmp_path / "file"))
    with pytest.raises(
        NotADirectoryError,
        match=r"data directory '.*/file' \(config.data_dir "
        r"is '': \$TFJAX_DATA_DIR",
    ):
        checks.check_paths(tiny(data_dir=""), str(tmp_path / "run"))


def test_check_paths_init_from_must_hold_a_checkpoint_unless_resuming(tmp_path):
    data = str(tmp_path / "data")
    (tmp_path / "file").write_text("")
    for init_from, error, message in [
        ("missing", FileNotFoundError, r"config.init_from='.*/missing': no such directory"),
        ("file", NotADirectoryError, r"config.init_from='.*/file' is a file"),
        ("", None, None),  # a directory without checkpoints/<step>
    ]:
        config = tiny(data_dir=data, init_from=str(tmp_path / init_from))
        with pytest.raises(error or FileNotFoundError, match=message or "holds no checkpoint"):
            checks.check_paths(config, str(tmp_path / "run"))
    (tmp_path / "source" / "checkpoints" / "2").mkdir(parents=True)
    checks.check_paths(
        tiny(data_dir=data, init_from=str(tmp_path / "source")), str(tmp_path / "run")
    )
    # Resuming never reads init_from, so its source may have gone.
    (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
    checks.check_paths(
        tiny(data_dir=data, init_from=str(tmp_path / "missing")), str(tmp_path / "run")
    )
    assert sorted(os.listdir(tmp_path)) == ["file", "run", "source"]  # no data dir made


def test_check_paths_for_restoring_needs_a_checkpoint(tmp_path):
    config = tiny(data_dir=str(tmp_path / "data"))
    with pytest.raises(FileNotFoundError, match=r"--workdir='.*/run': no such directory"):
        checks.check_paths(config, str(tmp_path / "run"), restore=True)
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match=r"--workdir='.*/run' holds no checkpoint"):
        checks.check_paths(config, str(tmp_path / "run"), restore=True)
    (tmp_path / "run" / "checkpoints" / "10").mkdir(parents=True)
    checks.check_paths(config, str(tmp_path / "run"), restore=True)
    assert sorted(os.listdir(tmp_path)) == ["run"]


# ------------------------------------------------------------------------ experiments/run.py
NOISE = ("WARNING: All log messages before absl::InitializeLog()", "cudart_stub.cc")


def run(tmp_path, *args, config="configs/vit.py:tiny"):
    """experiments/run.py's (status, stderr lines) for a run in tmp_path/run that must fail."""
    (tmp_path / "file").write_text("")
    cmd = run_command(tmp_path / "run", tmp_path / "data", {}, config=os.path.join(ROOT, config))
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    # The CUDA plugin's lines when JAX is imported on a machine without a GPU are not ours.
    lines = [line for line in proc.stderr.splitlines() if not any(n in line for n in NOISE)]
    assert sorted(os.listdir(tmp_path)) == ["file"]  # no workdir, data or tokenizer made
    return proc.returncode, lines


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--config.optim.learnin_rate=1"],
            "configs/vit.py:tiny has no field optim.learnin_rate; did you mean "
            "optim.learning_rate?",
        ),
        (
            ["--config.learning_rate=1"],
            "has no field learning_rate; did you mean optim.learning_rate?",
        ),
        (["--config.optim.lr=1"], "has no field optim.lr; the fields of config.optim: b1, b2,"),
        (
            ["--config.batch_size.rows=1"],
            "--config.batch_size.rows: batch_size is a value (int), not a group of fields",
        ),
        (["--config.batch_size=abc"], "--config.batch_size=abc: invalid literal for int()"),
        (["--config.optim.learning_rate=-1"], "optim.learning_rate must be >= 0, got -1.0"),
        (["--config.model.variant=B/15"], "model.variant='B/15' is unknown"),
        (["--config.optim.schedule=linear"], "optim.schedule='linear' is unknown"),
        (["--config.profile.num_steps=-1"], "profile.num_steps must be >= 0, got -1"),
    ],
)
def test_run_refuses_a_bad_override_in_a_few_lines(tmp_path, args, message):
    status, lines = run(tmp_path, *args)
    assert status == 2
    assert len(lines) <= 2, lines
    assert message in "\n".join(lines)


@pytest.mark.parametrize(
    "args, config, message",
    [
        (["--workdir=file"], "configs/vit.py:tiny", "--workdir='file' is a file"),
        (["--config.data_dir=file"], "configs/vit.py:tiny", "config.data_dir='file' is a file"),
        (
            ["--config.init_from=nothing"],
            "configs/vit.py:tiny",
            "config.init_from='nothing': no such directory",
        ),
        (
            [],
            "configs/vit.py:tinyy",
            "--config="
            + os.path.join(ROOT, "configs/vit.py:tinyy")
            + ": configs/vit.py: unknown preset 'tinyy'; presets: ['digits', 'tiny',",
        ),
        ([], "configs/nope.py", f"--config={os.path.join(ROOT, 'configs/nope.py')}: no such file"),
        (["--config.batch_size=8"], "configs/nope.py", "configs/nope.py: no such file"),
    ],
)
def test_run_refuses_bad_paths_and_config_files_in_a_few_lines(tmp_path, args, config, message):
    status, lines = run(tmp_path, *args, config=config)
    assert status == 2
    assert len(lines) <= 2, lines
    assert message in "\n".join(lines)
