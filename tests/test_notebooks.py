"""Every notebook in notebooks/ runs from start to end without an error (nbclient, tiny mode).

The kernel is the "python3" kernel, which jupyter_client starts with this interpreter, so it
sees the same tfjax. It inherits the environment (8 CPU devices from conftest.py) plus:

  TFJAX_NOTEBOOK_TINY=1     notebooks shrink their runs to a handful of steps
  TFJAX_NOTEBOOK_WORKDIR    where notebooks write their runs (a temporary folder)
  TFJAX_DATA_DIR            prepared datasets (the session's temporary data folder)

Each notebook runs in its own folder, as Jupyter and Colab run it.
"""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = sorted(f for f in os.listdir(NOTEBOOK_DIR) if f.endswith(".ipynb"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # The same folder as tests/test_configs.py uses: embedded datasets are built once a session.
    return str(tmp_path_factory.getbasetemp() / "tfjax_data")


def _run(name, workdir, data_dir):
    """Executes notebooks/<name> in tiny mode; a failing cell raises CellExecutionError, whose
    message holds the cell's source and traceback."""
    nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
    env = dict(
        os.environ,
        TFJAX_NOTEBOOK_TINY="1",
        TFJAX_NOTEBOOK_WORKDIR=str(workdir),
        TFJAX_DATA_DIR=data_dir,
    )
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=600,  # per cell
        resources={"metadata": {"path": NOTEBOOK_DIR}},
    )
    client.execute(env=env)
    return nb


def _assert_png(path):
    assert os.path.isfile(path), f"{path} was not written"
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert os.path.getsize(path) > 1000, f"{path} is (nearly) empty"


def test_notebooks_are_found():
    assert set(NOTEBOOKS) >= {"quickstart.ipynb", "reuse_in_flax.ipynb"}


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, data_dir):
    _run(name, tmp_path / "work", data_dir)
    if name == "quickstart.ipynb":
        plots = tmp_path / "work" / "vit_digits" / "plots"
        _assert_png(str(plots / "curves.png"))
        _assert_png(str(plots / "attention.png"))


def test_notebooks_are_stored_without_outputs():
    for name in NOTEBOOKS:
        nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{name} cell {i}"
