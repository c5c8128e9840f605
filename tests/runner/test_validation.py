"""A user's mistakes are refused before any work starts, in a few lines naming the field or flag,
the value and what is allowed: checks.check_config (values), checks.check_paths
(--workdir, data_dir, init_from) and experiments/run.py's command line (real subprocesses)."""

import os
import re
import subprocess

import pytest
from conftest import ROOT, plain_env, run_command, run_python, set_fields

from tfjax.runner import checks, setup


def tiny(name="vit", **overrides):
    return set_fields(
        setup.load_config(os.path.join(ROOT, "configs", f"{name}.py:tiny")), overrides
    )


# ------------------------------------------------------------------------------- check_config
NUMBER = "a finite number"  # the words of a number's rule (tfjax.allowed)
FRACTION = r"a number in \[0, 1\)"


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        (
            "vit",
            {"optim.learning_rate": -1e-3},
            rf"optim.learning_rate must be {NUMBER} >= 0, got -0.001",
        ),
        (
            "vit",
            {"optim.learning_rate": float("nan")},
            rf"optim.learning_rate must be {NUMBER} >= 0, got nan",
        ),
        ("vit", {"optim.b1": float("inf")}, rf"optim.b1 must be {FRACTION}, got inf"),
        ("vit", {"optim.b2": 1.0}, rf"optim.b2 must be {FRACTION}, got 1.0"),
        (
            "mlm",
            {"optim.weight_decay": -0.01},
            rf"optim.weight_decay must be {NUMBER} >= 0, got -0.01",
        ),
        (
            "vit",
            {"optim.grad_clip_norm": float("-inf")},
            r"optim.grad_clip_norm must be .* got -inf",
        ),
        ("vit", {"optim.eps": -1e-8}, rf"optim.eps must be {NUMBER} >= 0"),
        ("vit", {"optim.warmup_steps": -1}, r"optim.warmup_steps must be an integer >= 0, got -1"),
        ("vit", {"optim.end_learning_rate_fraction": -0.1}, r"end_learning_rate_fraction must be"),
        ("vit", {"optim.ema_decay": 1.0}, rf"optim.ema_decay must be {FRACTION}, got 1.0"),
        ("lm", {"optim.schedule": "linear"}, r"optim.schedule must be one of \('rsqrt', 'warmup"),
        ("lm", {"optim.name": "adam"}, r"optim.name must be one of \('adamw', 'sgd'\), got 'adam'"),
        ("lm", {"optim.warmup_steps": 2}, r"num_train_steps \(2\) > optim.warmup_steps \(2\)"),
        ("translate", {"optim.warmup_steps": 0}, r"'rsqrt' needs optim.warmup_steps >= 1"),
        ("vit", {"seed": -1}, r"^seed must be an integer in \[0, 9223372036854775807\], got -1$"),
        ("vit", {"eval_every": -1}, r"^eval_every must be an integer >= 0, got -1$"),
        ("vit", {"dtype": "float16"}, r"^dtype must be one of \('float32', 'bfloat16'\)"),
        ("vit", {"mesh.fsdp": 0}, r"mesh.fsdp must be -1 \(the devices the others leave\) or an"),
        ("vit", {"mesh.fsdp": -1}, r"mesh.data and mesh.fsdp are both -1; at most one axis"),
        ("lm", {"loss.z_loss": -1e-4}, rf"loss.z_loss must be {NUMBER} >= 0, got -0.0001"),
        (
            "vit",
            {"loss.label_smoothing": float("nan")},
            rf"loss.label_smoothing must be {FRACTION}",
        ),
        ("lm", {"decode.temperature": 0.0}, rf"decode.temperature must be {NUMBER} > 0, got 0.0"),
        ("lm", {"decode.top_p": 0.0}, r"decode.top_p must be a number in \(0, 1\], got 0.0"),
        ("translate", {"decode.beam_size": 0}, r"decode.beam_size must be at least 1 for beam"),
        ("finetune", {"lora.dropout": 1.0}, rf"lora.dropout must be {FRACTION}, got 1.0"),
        ("finetune", {"lora.base_dtype": "int4"}, r"lora.base_dtype must be one of \('', 'int8'"),
        ("vit", {"checkpoint.keep": 0}, r"checkpoint.keep must be an integer >= 1, got 0"),
        ("vit", {"checkpoint.best_mode": "lowest"}, r"checkpoint.best_mode must be one of"),
        ("vit", {"checkpoint.timeout_s": 0}, r"checkpoint.timeout_s must be an integer >= 1"),
        ("vit", {"checkpoint.restore_step": -1}, r"checkpoint.restore_step must be an integer"),
        ("lm", {"profile.num_steps": -1}, r"profile.num_steps must be an integer >= 0, got -1"),
        (
            "vit",
            {"profile.start_step": 0, "profile.num_steps": 1},
            r"profile.start_step must be an integer >= 1",
        ),
        (
            "vit",
            {"model.variant": "B/15"},
            r"model.variant='B/15' is unknown for "
            r"model.name='vit'; allowed: tiny/2, .*B/16",
        ),
        ("lm", {"model.variant": "gpt5"}, r"model.variant='gpt5' .* allowed: .*gpt2-small"),
        ("lm", {"model.name": "gpt"}, r"model.name='gpt': tfjax.models has no such model family"),
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


# ---------------------------------------------------------------------------------- check_run
@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("vit", {"model.width": 0}, r"^model.width must be an integer >= 1, got 0$"),
        ("vit", {"model.width": -64}, r"^model.width must be an integer >= 1, got -64$"),
        ("vit", {"model.num_heads": 3}, r"^model.num_heads=3 must divide model.width=32$"),
        ("vit", {"model.dropout_rate": 1.5}, r"^model.dropout_rate must be a number in \[0, 1\)"),
        ("vit", {"model.pool": "max"}, r"^model.pool must be one of \('cls', 'gap'"),
        (
            "vit",
            {"model.num_classes": 5},
            r"^model.num_classes=5 is fewer than dataset.num_classes=10 \(dataset 'digits'\)",
        ),
        ("vit", {"model.variant": "tiny/16"}, r"image size 8x8 is not divisible by patch_size=16"),
        (
            "vit",
            {"dataset.crop_padding": -1},
            r"^dataset 'digits': crop_padding must be an integer",
        ),
        ("vit", {"dataset.num_classes": 5}, r"num_classes=5 is fewer than the dataset's 10 labels"),
        ("vit", {"dataset.num_channels": 3}, r"'digits': num_channels=3 must be 1, the channels"),
        ("lm", {"model.mlp_dim": 0}, r"^model.mlp_dim must be an integer >= 1, got 0$"),
        ("lm", {"model.dropout_rate": float("nan")}, r"^model.dropout_rate must be a number in"),
        ("lm", {"model.implementation": "flash"}, r"^model.implementation must be one of \('xla'"),
        ("lm", {"model.max_len": 16}, r"^model.name='decoder' .*: tokens are 32 long; max_len=16"),
        (
            "lm",
            {"dataset.tokenizer": "sentencepiece", "dataset.vocab_size": 100},
            r"'pydoc': vocab_size=100 is too small for SentencePiece",
        ),
        ("lm", {"optim.freeze": "nothing"}, r"^optim.freeze='nothing' freezes no parameter"),
        ("mlm", {"model.norm_position": "middle"}, r"^model.norm_position must be one of"),
        ("mlm", {"dataset.mlm_probability": 0.0}, r"mlm_probability must be a number in \(0, 1\)"),
        ("translate", {"model.vocab_size": -5}, r"^model.vocab_size must be an integer >= 1"),
    ],
)
def test_check_run_refuses_bad_model_and_dataset_fields_before_any_work(
    tmp_path, name, overrides, message
):
    """The dataset config resolved and the model built abstractly (the family's field checks,
    one trace of its initialisation): one line naming the field, nothing written."""
    config = tiny(name, data_dir=str(tmp_path / "data"), **overrides)
    with pytest.raises(ValueError, match=message):
        setup.check_run(config, str(tmp_path / "run"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mesh.fsdp": 3}, "the fixed sizes multiply to 3, which does not divide the 8 devices"),
        ({"batch_size": 12}, "batch_size=12 is not divisible by 8 (the data-parallel size"),
    ],
)
def test_fields_the_devices_cannot_honour_are_config_errors_before_any_work(
    tmp_path, overrides, message
):
    """Once JAX has the devices (8 here), before any work: a ConfigError, which
    experiments/run.py reports as the checks before it (one line, status 2)."""
    config = tiny(data_dir=str(tmp_path / "data"), **overrides)
    with pytest.raises(checks.ConfigError, match=re.escape(message)):
        setup.prepare(config, str(tmp_path / "run"))
    assert os.listdir(tmp_path) == []


def test_check_run_starts_no_backend(tmp_path):
    """experiments/run.py checks before JAX starts a backend (a distributed start, the platform
    and the host memory settings must come first): after check_run, a platform chosen still
    applies, so asking for the devices fails on an unknown one."""
    code = f"""
import jax
from tfjax.runner import checks, setup
for name in ("vit", "lm", "mlm", "translate"):
    setup.check_run(setup.load_config(f"configs/{{name}}.py:tiny"), {str(tmp_path / "run")!r})
jax.config.update("jax_platforms", "none_such")
try:
    jax.devices()
except RuntimeError as e:
    print("no backend before:", e)
"""
    proc = run_python("-c", code, env=plain_env(TFJAX_DATA_DIR=str(tmp_path / "data")))
    assert "no backend before:" in proc.stdout, proc.stderr[-3000:]
    assert os.listdir(tmp_path) == []


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
        (
            ["--config.optim.learning_rate=nan"],
            "optim.learning_rate must be a finite number >= 0, got nan",
        ),
        (["--config.model.variant=B/15"], "model.variant='B/15' is unknown"),
        # the model's and the dataset's fields, and the head against the dataset's classes
        (["--config.model.width=-64"], "model.width must be an integer >= 1, got -64"),
        (["--config.dataset.crop_padding=-1"], "crop_padding must be an integer >= 0, got -1"),
        (["--config.model.num_classes=5"], "model.num_classes=5 is fewer than dataset.num_"),
        # a best metric the evaluation never gives; a step to restore that the workdir lacks
        (
            ["--config.checkpoint.best_metric=bleu"],
            "checkpoint.best_metric='bleu' is not an eval metric of task='classification'",
        ),
        (["--config.checkpoint.restore_step=5"], "restore_step=5: "),
    ],
)
def test_run_refuses_a_bad_override_in_a_few_lines(tmp_path, args, message):
    status, lines = run(tmp_path, *args)
    assert status == 2
    assert len(lines) <= 2, lines
    assert message in "\n".join(lines)


def test_a_label_past_the_head_stops_the_run_in_a_line_naming_the_record(
    data_dir, runner_env, tmp_path
):
    """Records whose label has no logit (here digits declared with 5 classes, as a dataset whose
    records disagree with its num_classes; glue's test split labels -1): the first batch that
    holds one stops experiments/run.py with one line naming the split, the record, the label
    and what is allowed, status 1; never a NaN loss blamed on the learning rate."""
    args = run_command(tmp_path / "run", data_dir, {})[1:]
    code = (
        "import runpy, sys; from tfjax.data import catalog; "
        "catalog.CATALOG['digits']['config']['num_classes'] = 5; "
        f"sys.argv = {args!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    proc = run_python("-c", code, env=runner_env)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("run.py:")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "FloatingPointError" not in proc.stderr
    assert len(lines) == 1
    assert re.search(
        r"^run.py: LabelError: dataset 'digits', split 'train' record \d+: field 'label' is "
        r"[5-9], outside dataset.num_classes=5 \(allowed: 0 to 4\)",
        lines[0],
    ), lines


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
