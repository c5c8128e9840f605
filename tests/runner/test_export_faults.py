"""experiments/export.py when things go wrong: what it refuses and why (a QLoRA run's adapters
alone, a moved base and the flag that finds it), a read-only or full file system, and an export
killed part-way: `output` is whole or absent, the hidden directory a killed export leaves is
removed by the next one, and the rerun writes what an uninterrupted export writes.

One LoRA run (3 steps) from a small untrained Llama-shaped checkpoint (tests/finetune_checkpoints)
serves every test; its in-process export is the reference the others are compared with.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import finetune_checkpoints as fc
import pytest
from conftest import ROOT, plain_env, run_python, set_fields

from tfjax.runner import checkpoint, export, train

FINETUNE = os.path.join(ROOT, "configs", "finetune.py")
EXPORT = os.path.join(ROOT, "experiments", "export.py")

pytestmark = pytest.mark.usefixtures("compilation_cache")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(the checkpoint, the LoRA run's workdir, {file: bytes} of its full export)."""
    root = tmp_path_factory.mktemp("lora_run")
    base = fc.build("llama", root / "checkpoint", steps=0)
    rows = fc.write_jsonl(root / "train.jsonl", fc.task_rows("reverse", 40, 11))
    config = train.load_config(f"{FINETUNE}:lora,tiny")
    set_fields(
        config,
        {
            "init_from": base,
            "dataset.train_files": rows,
            "dataset.eval_files": rows,
            "num_train_steps": 3,
            "eval_every": 0,
            "eval_steps": 1,
            "checkpoint.every": 3,
        },
    )
    workdir = str(root / "run")
    train.train_and_evaluate(config, workdir)
    reference = _files(export.export_run(workdir, str(root / "reference")))
    return base, workdir, reference


def _files(directory) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def _staged(parent) -> list[str]:
    """The hidden directories of exports in `parent` (export.STAGED)."""
    return sorted(n for n in os.listdir(parent) if export.STAGED in n)


def _workdir_config(tmp_path, **fields) -> str:
    """A workdir holding only a config.json of `fields` (what the refusals read)."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps(fields))
    return str(workdir)


# ---------------------------------------------------------------------------- what is refused
@pytest.mark.parametrize("base_dtype", ["int8", "nf4"])
def test_a_qlora_runs_adapters_alone_are_refused_naming_the_merged_export(base_dtype, tmp_path):
    """The adapters were trained on the quantized base: peft on the float checkpoint computes
    another model (0.52 off on logits of scale 9.8, measured), so --adapters_only of a QLoRA
    run is refused before any work, pointing at the full export."""
    workdir = _workdir_config(
        tmp_path, init_from=str(tmp_path), lora={"rank": 4, "base_dtype": base_dtype}
    )
    output = tmp_path / "adapters"
    with pytest.raises(
        ValueError,
        match=rf"^--adapters_only: lora.base_dtype='{base_dtype}': this QLoRA run's adapters "
        r"were trained on its quantized base, which no base that peft loads reproduces .* "
        r"export without the flag: the adapters merged into the dequantized kernels",
    ):
        export.export_run(workdir, str(output), adapters_only=True)
    assert os.listdir(tmp_path) == ["run"]  # nothing written, not even the hidden directory


def test_adapters_only_takes_gpt2_and_refuses_what_is_no_causal_lm(tmp_path):
    """GPT-2 (GPT2LMHeadModel, which AutoModelForCausalLM loads) was refused as "not a causal
    LM" for its name; a decoder-only checkpoint passes, a vision tower is refused for what it
    is."""
    import ml_collections
    import transformers

    gpt2 = tmp_path / "gpt2"
    small = dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=8, **small)).save_pretrained(
        gpt2
    )
    dinov2 = tmp_path / "dinov2"  # a vision tower: a classification run's base
    transformers.Dinov2Model(
        transformers.Dinov2Config(image_size=8, patch_size=4, mlp_ratio=2, **small)
    ).save_pretrained(dinov2)
    kept = str(tmp_path / "no_kept_files")  # nothing to compare the config.json with

    def config(init_from):
        return ml_collections.ConfigDict({"init_from": str(init_from), "lora": {"rank": 2}})

    assert export._adapter_base(config(gpt2), kept) == str(gpt2)
    with pytest.raises(
        ValueError,
        match=r"^--adapters_only: config.init_from='.*/dinov2' is a Dinov2Model, not a "
        r"decoder-only LM; peft adapters are written for causal LMs",
    ):
        export._adapter_base(config(dinov2), kept)


def test_a_moved_base_is_found_by_config_init_from(lora_run, tmp_path):
    """The run's checkpoint moved (the workdir records a place that is gone): the export names
    --config.init_from, which gives the new place; the base there is checked, the export is
    the reference's, and the adapters' base_model_name_or_path is the new place."""
    base, workdir, reference = lora_run
    moved = shutil.copytree(base, tmp_path / "moved")
    copy = shutil.copytree(workdir, tmp_path / "run")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "init_from": str(tmp_path / "gone")}))
    with pytest.raises(checkpoint.CheckpointMismatchError, match="--config.init_from"):
        export.export_run(str(copy), str(tmp_path / "no_flag"))
    assert _files(export.export_run(str(copy), str(tmp_path / "hf"), init_from=str(moved))) == (
        reference
    )
    adapters = export.export_run(
        str(copy), str(tmp_path / "adapters"), adapters_only=True, init_from=str(moved)
    )
    with open(os.path.join(adapters, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == str(moved)


def test_config_init_from_is_a_flag_of_export_py(tmp_path):
    """experiments/export.py takes the flag the moved-base message names (run.py's and
    decode.py's); on a run that did not start from a checkpoint it is one line."""
    workdir = _workdir_config(tmp_path, init_from="", lora={"rank": 0})
    proc = run_python(
        EXPORT, f"--workdir={workdir}", f"--output={tmp_path / 'hf'}", "--config.init_from=/x"
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "export.py: ValueError: --config.init_from='/x': the run did not start from a "
        "checkpoint (its config.json has no init_from); leave the flag out"
    )


def test_a_hugging_face_checkpoint_as_workdir_is_one_line(lora_run, tmp_path):
    """Its config.json is not a run's: read as one, it was an AttributeError traceback
    ('logical_axis_rules'). Nothing is written."""
    base = lora_run[0]
    with pytest.raises(
        ValueError,
        match=rf"^--workdir='{base}' is a Hugging Face checkpoint, not a run's workdir \(it has "
        r"no checkpoints/\): there is nothing to export; transformers and --config.init_from "
        "take it as it is$",
    ):
        export.export_run(base, str(tmp_path / "hf"))
    assert os.listdir(tmp_path) == []


def test_decode_py_reads_a_lora_runs_base_where_its_config_json_records_it(lora_run, tmp_path):
    """decode.py without --config.init_from on a LoRA run whose base never moved: it said "put
    it back, or give its new place"; it takes the recorded place, as export.py does (tested
    here, where a LoRA run is at hand)."""
    base, workdir, _ = lora_run
    proc = run_python(
        os.path.join(ROOT, "experiments", "decode.py"),
        f"--config={FINETUNE}:lora,tiny",
        f"--workdir={workdir}",
        "--input=abc",
        "--max_new_tokens=2",
    )
    assert proc.returncode == 0 and proc.stdout.startswith("abc\t"), proc.stderr[-2000:]
    assert (
        "config.init_from is unset: the base of this LoRA run's adapters is read from "
        f"{base}, as its config.json records"
    ) in proc.stderr


# ---------------------------------------------------------------------- unwritable file systems
def test_a_read_only_or_full_file_system_is_one_line_naming_the_output(lora_run, tmp_path):
    """Real file systems in a private mount namespace (as tests/runner/test_workdir_faults.py's
    full disk): a read-only tmpfs is refused before the checkpoint is read, a 64 KiB one (the
    weights are 444 KiB) before anything is written; one line each, status 1, no traceback,
    nothing left there."""
    _, workdir, _ = lora_run
    read_only, full = tmp_path / "read_only", tmp_path / "full"
    read_only.mkdir()
    full.mkdir()
    export_py = f"{sys.executable} {EXPORT} --workdir={workdir}"
    script = textwrap.dedent(f"""
        mount -t tmpfs -o ro tmpfs {read_only} || exit 99
        mount -t tmpfs -o size=64k tmpfs {full} || exit 99
        {export_py} --output={read_only}/hf > {tmp_path}/ro.out 2>&1; echo $? >> {tmp_path}/ro.out
        {export_py} --output={full}/hf > {tmp_path}/full.out 2>&1; echo $? >> {tmp_path}/full.out
        ls -A {read_only} > {tmp_path}/ro.left; ls -A {full} > {tmp_path}/full.left
    """)
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    proc = subprocess.run(
        [*unshare, "bash", "-c", script],
        cwd=ROOT,
        env=plain_env(),
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"cannot mount a tmpfs here: {proc.stderr[-1000:]}"
    for name, output, why in (
        (
            "ro",
            read_only / "hf",
            f"could not be written: read-only file system (in {read_only}); nothing was left "
            "there; give another --output, one this user may write",
        ),
        ("full", full / "hf", ", and its file system has 64.0 KiB free of 64.0 KiB; nothing"),
    ):
        out = (tmp_path / f"{name}.out").read_text()
        *lines, status = out.strip().splitlines()
        assert status == "1" and "Traceback" not in out, out[-3000:]
        assert lines[-1].startswith(f"export.py: ExportWriteError: --output='{output}'"), out
        assert why in lines[-1], lines[-1]
        assert (tmp_path / f"{name}.left").read_text() == ""  # no hidden directory either


@pytest.mark.parametrize("fails", ["weights", "tokenizer"])
def test_a_disk_that_fills_while_writing_leaves_nothing(fails, lora_run, tmp_path, monkeypatch):
    """The space check passed, then the file system filled: safetensors' own error (no
    OSError: "... (os error 28)") while writing the weights, or an OSError copying the
    tokenizer files, is an ExportWriteError naming `output`; neither it nor a hidden
    directory is left."""
    import errno

    from safetensors import SafetensorError

    _, workdir, _ = lora_run

    def full(*args, **kwargs):
        if fails == "weights":
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )
        raise OSError(errno.ENOSPC, "No space left on device", args[1])  # the copy's

    target = "tfjax.interop.write_safetensors" if fails == "weights" else "shutil.copy2"
    monkeypatch.setattr(target, full)
    output = tmp_path / "hf"
    with pytest.raises(export.ExportWriteError) as e:
        export.export_run(workdir, str(output))
    assert str(e.value).startswith(
        f"--output='{output}' could not be written: no space left on device ("
    )
    assert f"(in {tmp_path}); nothing was left there; make room, or give another" in str(e.value)
    assert os.listdir(tmp_path) == []


# -------------------------------------------------------------------------- killed part-way
KILL_WHILE_WRITING = """
import os, shutil, signal, sys
from tfjax.runner import export
copy2 = shutil.copy2
def copy_then_die(*args, **kwargs):  # the weights written, one tokenizer file copied
    copy2(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
shutil.copy2 = copy_then_die
export.export_run(sys.argv[1], sys.argv[2])
"""


def test_a_killed_export_leaves_nothing_a_rerun_misreads(lora_run, tmp_path):
    """SIGKILL while writing (the process kills itself after the weights), then at random
    moments of experiments/export.py (KILL_TRIALS of them, as in test_kill_trials.py; 1 by
    default): `output` is absent or whole, and the rerun (in this process) removes the hidden
    directory the kill left and writes the reference's files."""
    _, workdir, reference = lora_run
    rng = random.Random(int(os.environ.get("KILL_SEED", "0")))
    for trial in range(1 + int(os.environ.get("KILL_TRIALS", "1"))):
        parent = tmp_path / f"trial_{trial}"
        parent.mkdir()
        output = parent / "hf"
        if trial == 0:
            args = ["-c", KILL_WHILE_WRITING, workdir, str(output)]
            proc = subprocess.run(
                [sys.executable, *args], cwd=ROOT, env=plain_env(), capture_output=True
            )
            assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
            [left] = _staged(parent)
            assert "model.safetensors" in os.listdir(parent / left)
        else:
            proc = subprocess.Popen(
                [sys.executable, EXPORT, f"--workdir={workdir}", f"--output={output}"],
                cwd=ROOT,
                env=plain_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(rng.uniform(1.0, 6.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert not output.exists() or _files(output) == reference
        if output.exists():
            continue  # the kill came after the rename: the export is whole
        assert _files(export.export_run(workdir, str(output))) == reference
        assert os.listdir(parent) == ["hf"], trial


def test_a_live_exports_hidden_directory_is_left_alone(tmp_path):
    """The next export removes only the hidden directories no export holds (their flock)."""
    stale = tmp_path / f".old{export.STAGED}abcdefgh"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    live = export._Staged(str(tmp_path / "hf"))
    try:
        assert export.remove_stale(str(tmp_path)) == []  # the live export removed the stale one
        assert _staged(tmp_path) == [os.path.basename(live.path)]
    finally:
        live.close()
    assert os.listdir(tmp_path) == []
