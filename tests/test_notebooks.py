"""Every notebook in notebooks/ runs from start to end where people open it (nbclient, tiny mode).

Colab's layout (test_notebook_runs_in_colab_layout): a fresh runtime has JAX, Flax and friends
but not tfjax; its working directory is /content; the user has run `!git clone <url> tfjax`, so
/content/tfjax is the repository root, which `import tfjax` finds as an empty namespace package.
The test rebuilds that offline:

  runtime/   a fresh venv whose site-packages link every package of this venv except tfjax
             (no editable finder, no dist-info), started as the notebook's kernel
  content/   the kernel's working directory, holding tfjax/: a copy of this checkout's files
             (tracked and untracked, not ignored), as a clone would hold them

pip in the kernel may not reach an index (PIP_NO_INDEX) and builds tfjax with this venv's
setuptools; it may install nothing but tfjax. The kernel gets no XLA_FLAGS device count: a
fresh CPU runtime has one device unless a notebook asks for more.

A checkout opened in Jupyter (test_setup_cell_in_checkout): the "python3" kernel runs this
interpreter, where tfjax is installed; the first cell installs nothing.

Both inherit the environment (JAX_PLATFORMS from conftest.py) plus:

  TFJAX_NOTEBOOK_TINY=1     notebooks shrink their runs to a handful of steps
  TFJAX_NOTEBOOK_WORKDIR    where notebooks write their runs (a temporary folder)
  TFJAX_DATA_DIR            prepared datasets (the session's temporary data folder)

and finetune.ipynb, instead of downloading its checkpoint from the Hugging Face Hub:

  TFJAX_NOTEBOOK_CHECKPOINT a small untrained Qwen3 with its tokenizer and chat template, as
                            transformers saves it (tests/finetune_checkpoints.py)
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import finetune_checkpoints as fc
import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient

NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = sorted(f for f in os.listdir(NOTEBOOK_DIR) if f.endswith(".ipynb"))
COLAB_KERNEL = "tfjax-test-colab"


def _is_tfjax(name):
    return name == "tfjax" or name.startswith(
        ("tfjax-", "__editable__.tfjax", "__editable___tfjax")
    )


def _site_packages(prefix):
    return sysconfig.get_path("purelib", vars={"base": prefix, "platbase": prefix})


def _fresh_runtime(runtime):
    """A venv with this venv's packages, tfjax excepted; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(runtime)], check=True)
    ours, theirs = sysconfig.get_path("purelib"), _site_packages(str(runtime))
    for name in os.listdir(ours):
        if not _is_tfjax(name) and name != "__pycache__":
            os.symlink(os.path.join(ours, name), os.path.join(theirs, name))
    python = os.path.join(runtime, "bin", "python")
    probe = (
        "import importlib.util as u; print(u.find_spec('tfjax'), u.find_spec('flax') is not None)"
    )
    found = subprocess.run([python, "-c", probe], cwd=runtime, capture_output=True, text=True)
    assert found.stdout.split() == ["None", "True"], found  # no tfjax, the rest importable
    return python


def _clone(dest):
    """The checkout's files as a clone holds them: tracked and untracked, not ignored."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for rel in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, rel)):  # skips files deleted in the work tree
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), os.path.join(dest, rel))


def _kernel_spec(kernels, python):
    os.makedirs(kernels / COLAB_KERNEL)
    spec = {
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fresh runtime without tfjax",
        "language": "python",
    }
    (kernels / COLAB_KERNEL / "kernel.json").write_text(json.dumps(spec))


def _execute(nb, kernel_name, cwd, env):
    """Executes nb in place; a failing cell raises CellExecutionError, whose message holds the
    cell's source and traceback. Returns the text the cells printed."""
    client = NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=600,  # per cell
        resources={"metadata": {"path": str(cwd)}},
    )
    client.execute(env=env)
    return "".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "stream"
    )


def _env(workdir, data_dir, **extra):
    return dict(
        os.environ,
        TFJAX_NOTEBOOK_TINY="1",
        TFJAX_NOTEBOOK_WORKDIR=str(workdir),
        TFJAX_DATA_DIR=data_dir,
        **extra,
    )


def _read(name):
    return nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)


def _setup_only(name):
    """The notebook up to its first code cell (the setup cell)."""
    nb = _read(name)
    setup = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells = nb.cells[: setup + 1]
    return nb


def _assert_png(path):
    assert os.path.isfile(path), f"{path} was not written"
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert os.path.getsize(path) > 1000, f"{path} is (nearly) empty"


def _printed_number(printed, label):
    """The number printed after `label` (e.g. "max |tfjax - transformers| = ")."""
    match = re.search(re.escape(label) + r"([-+0-9.e]+)", printed)
    assert match, f"{label!r} was not printed: {printed}"
    return float(match.group(1))


@pytest.fixture(scope="module")
def untrained_qwen3(tmp_path_factory):
    """finetune.ipynb's checkpoint: transformers' files of a small Qwen3, untrained (cheaper; the
    notebook's checks hold for any weights)."""
    return fc.build("qwen3", tmp_path_factory.mktemp("checkpoint") / "qwen3", steps=0)


def test_notebooks_are_found():
    assert set(NOTEBOOKS) >= {"quickstart.ipynb", "reuse_in_flax.ipynb", "finetune.ipynb"}


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_colab_layout(name, tmp_path, data_dir, monkeypatch, request):
    python = _fresh_runtime(tmp_path / "runtime")
    _kernel_spec(tmp_path / "kernels", python)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))  # finds kernels/<COLAB_KERNEL>
    content = tmp_path / "content"
    _clone(content / "tfjax")
    xla_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    checkpoint = {}
    if name == "finetune.ipynb":
        checkpoint["TFJAX_NOTEBOOK_CHECKPOINT"] = request.getfixturevalue("untrained_qwen3")
    env = _env(
        tmp_path / "work",
        data_dir,
        XLA_FLAGS=" ".join(xla_flags),
        PIP_NO_INDEX="1",
        PIP_NO_BUILD_ISOLATION="0",  # sic: "0" turns build isolation off (no setuptools download)
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_CACHE_DIR=str(tmp_path / "pip-cache"),
        **checkpoint,
    )
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)

    printed = _execute(_read(name), COLAB_KERNEL, content, env)

    # The first cell installed tfjax into the runtime, and nothing else (JAX stayed as it was).
    site = _site_packages(str(tmp_path / "runtime"))
    installed = sorted(n for n in os.listdir(site) if not os.path.islink(os.path.join(site, n)))
    installed = [n for n in installed if n != "__pycache__"]
    assert len(installed) == 2 and all(map(_is_tfjax, installed)), installed
    assert os.path.isfile(os.path.join(site, "tfjax", "__init__.py"))
    if name == "quickstart.ipynb":
        plots = tmp_path / "work" / "vit_digits" / "plots"
        _assert_png(str(plots / "curves.png"))
        _assert_png(str(plots / "attention.png"))
    if name == "reuse_in_flax.ipynb":
        # The notebook asked for 8 CPU devices itself and split the model over them.
        assert "mesh: {'data': 4, 'model': 2}" in printed, printed
        # Its NNX section: a block sharded as made, and a family model on Linen's parameters.
        assert "NNX FFN kernel (64, 256) is sharded as P(None, 'model')" in printed, printed
        assert "NNX vs Linen logits, same parameters: " in printed, printed
        assert "same parameter tree: True" in printed, printed
    if name == "finetune.ipynb":
        # The eval loss fell, the samples of both evaluations were shown (each prompt whole, as
        # the chat template rendered it), and transformers' logits of the export equal tfjax's
        # (the notebook asserts this too).
        before = _printed_number(printed, "eval loss: ")
        after = _printed_number(printed, "at step 0 (the checkpoint's own), ")
        assert after < before, printed
        prompt = (
            re.escape(r"'<|im_start|>user\nWrite ")
            + r"\d+"
            + re.escape(r" in words.<|im_end|>\n<|im_start|>assistant\n' -> ")
        )
        for when in (r"before fine-tuning \(step 0\)", r"after fine-tuning \(step [1-9]\d*\)"):
            assert re.search(rf"--- {when}\n{prompt}", printed), printed
        assert re.search(r"transformers: 'Write \d+ in words\.' -> ", printed), printed
        # float32 rounding only: the notebook allows 1e-3 of the largest logit for any
        # checkpoint; this small one agrees as closely as tests/interop's references do.
        assert _printed_number(printed, "max |tfjax - transformers| = ") <= 1e-5, printed
        _assert_png(str(tmp_path / "work" / "finetune" / "plots" / "curves.png"))
        assert "curves.png: " in printed, printed
        export = tmp_path / "work" / "finetuned_hf"
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(export))

    # Runtime > Restart session, then the first cell again: tfjax is found, not installed again.
    record = os.path.join(site, next(n for n in installed if n.endswith(".dist-info")), "RECORD")
    before = os.stat(record).st_ctime_ns
    _execute(_setup_only(name), COLAB_KERNEL, content, env)
    assert os.stat(record).st_ctime_ns == before, "the first cell installed tfjax again"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_setup_cell_in_checkout(name, tmp_path, data_dir):
    """Jupyter opened in notebooks/ of a checkout with tfjax installed: the first cell finds it
    and installs nothing; tfjax is the checkout's."""
    nb = _setup_only(name)
    nb.cells.append(nbformat.v4.new_code_cell("import tfjax\nprint('tfjax at', tfjax.__file__)"))
    # Any pip install fails here (no index to fetch setuptools for the isolated build; a dry
    # run at most), so the cell errors if it tries, and this venv (shared by the tests) is kept.
    env = _env(tmp_path, data_dir, PIP_NO_INDEX="1", PIP_DRY_RUN="1")
    env.pop("PIP_NO_BUILD_ISOLATION", None)
    printed = _execute(nb, "python3", NOTEBOOK_DIR, env)
    assert f"tfjax at {os.path.join(ROOT, 'tfjax', '__init__.py')}" in printed, printed


def test_notebooks_are_stored_without_outputs():
    for name in NOTEBOOKS:
        nb = _read(name)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{name} cell {i}"
