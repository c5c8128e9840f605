"""Every ```python block of README.md and docs/*.md runs as written, so none can drift from
the code.

Each block runs in a fresh Python process, in a new temporary directory that holds a link to
the checkout's `configs/` (the pages' commands run from the checkout), with the 8 CPU devices
conftest asks XLA for. A failure names the page and line of the statement that raised and the
error.

Most blocks run exactly as written. A block that needs something its page says to make first
(a trained run, a downloaded checkpoint) gets it from its entry in PREPARED, keyed by the
block's first line: a tiny stand-in made in the temporary directory, and the text replacements
that point the block at the tiny config. Each replacement must match the block, or the test
fails: a block that changes is never run half-substituted. No block is left out. A block that
appears word for word on several pages (the README's examples are copies of the pages') runs
once, its test named after every place it stands.
Shell blocks (```bash and plain ```) are not run here: `make train` has tests/test_quickstart.py.
"""

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
from conftest import ROOT

README = os.path.join(ROOT, "README.md")
# The README and every page of docs/ (design.md included), as paths relative to the checkout.
PAGES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
BLOCK_FILE = "readme_block.py"


@dataclasses.dataclass(frozen=True)
class Block:
    line: int  # the page's line of the block's first code line
    code: str
    page: str = "README.md"  # relative to the checkout

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0].strip()

    @property
    def place(self) -> str:
        return f"{self.page}:{self.line}"


def readme_blocks(path: str = README, page: str | None = None) -> list[Block]:
    """The ```python blocks of a Markdown file, with the line each one's code starts on."""
    page = page or os.path.basename(path)
    blocks, code, start = [], None, 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            fence = re.match(r"^\s*```\s*(\S*)", line)
            if code is None and fence:
                if fence.group(1).lower() in ("python", "py"):
                    code, start = [], number + 1
                else:  # another language: skip to its closing fence
                    code, start = False, number + 1
            elif code is not None and fence and not fence.group(1):
                if code is not False:
                    blocks.append(Block(start, "".join(code), page))
                code = None
            elif code is not None and code is not False:
                code.append(line)
    assert code is None, f"{page}:{start - 1}: a fenced block is never closed"
    return blocks


def pages_blocks() -> list[list[Block]]:
    """Every page's ```python blocks, one list per distinct code: the copies of a block (the
    README's examples repeat the pages' blocks word for word) run once, as written."""
    runs: dict[str, list[Block]] = {}
    for page in PAGES:
        for block in readme_blocks(os.path.join(ROOT, page), page):
            runs.setdefault(block.code, []).append(block)
    return list(runs.values())


# ------------------------------------------------------------------------- what a block needs


def _tiny_gpt2_checkpoint(cwd: str) -> None:
    """A Hugging Face GPT-2 directory (config.json + model.safetensors) at path/to/gpt2, as
    `save_pretrained` writes it: GPT-2's vocabulary, 2 layers of width 32, random weights."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(os.path.join(cwd, "path", "to", "gpt2"), safe_serialization=True)


def _tiny_translate_run(cwd: str) -> None:
    """workdirs/translate_demo as `make train CONFIG=configs/translate.py:demo` leaves it, but
    trained with configs/translate.py:tiny (2 steps, byte tokenizer) in a few seconds."""
    from tfjax.runner import train

    config = train.load_config(os.path.join(ROOT, "configs", "translate.py:tiny"))
    config.data_dir = os.environ["TFJAX_DATA_DIR"]
    train.train_and_evaluate(config, os.path.join(cwd, "workdirs", "translate_demo"))


@dataclasses.dataclass(frozen=True)
class Prepared:
    why: str  # what the block's page says it needs
    setup: Callable[[str], None]  # makes it in the block's working directory
    replace: tuple[tuple[str, str], ...] = ()  # (as written, as run) in the block's text


PREPARED = {
    "# path/to/gpt2: a local Hugging Face GPT-2 checkpoint directory": Prepared(
        "a local Hugging Face GPT-2 checkpoint directory at path/to/gpt2",
        _tiny_gpt2_checkpoint,
    ),
    "# After `make train CONFIG=configs/translate.py:demo`, in the checkout:": Prepared(
        "a trained translation demo run in workdirs/translate_demo",
        _tiny_translate_run,
        (('"configs/translate.py:demo"', '"configs/translate.py:tiny"'),),
    ),
}

# ------------------------------------------------------------------------------------ tests

RUNS = pages_blocks()

# Blocks that share a first line (two load the same GPT-2 directory, one as Linen and one as
# NNX; two start with the same imports) run in one process, one after another, each as written
# in a namespace of its own, in one working directory that their PREPARED entry fills once:
# one interpreter start-up, import of JAX and preparation for the lot, as a reader running
# the examples in turn has.
RUNNER = """
import json, sys, traceback
failures = []
for path in sys.argv[1:]:
    print(f"--- running {path}", file=sys.stderr, flush=True)
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), {"__name__": "__main__", "__file__": path})
    except BaseException:
        failures.append(traceback.format_exc())
    else:
        failures.append(None)
with open("failures.json", "w", encoding="utf-8") as f:
    json.dump(failures, f)
"""
_GROUP_FAILURES: dict[str, list[str | None]] = {}  # first line -> each run's traceback or None


def test_the_pages_have_their_python_blocks_and_every_table_entry_names_one():
    readme = [b.first_line for b in readme_blocks()]
    assert len(readme) >= 3, f"README.md has only {len(readme)} ```python blocks: {readme}"
    assert len(RUNS) >= 5, f"README.md and docs/ have only {len(RUNS)} distinct blocks"
    firsts = {run[0].first_line for run in RUNS}
    stale = sorted(set(PREPARED) - firsts)
    assert not stale, f"entries for blocks that README.md and docs/ no longer have: {stale}"


def _failure(block: Block, error_text: str, copies=()) -> str:
    """The page and line of the deepest frame in the block, and the error."""
    frames = re.findall(rf'File "[^"]*{re.escape(BLOCK_FILE)}", line (\d+)', error_text)
    where = block.line + int(frames[-1]) - 1 if frames else block.line
    lines = [s for s in error_text.strip().splitlines() if s.strip()]
    error = lines[-1] if lines else "nothing on stderr"
    statement = block.code.splitlines()[where - block.line].strip() if frames else ""
    return (
        f"{block.page}:{where}: the ```python block starting at line {block.line} fails"
        + (f" (its copies: {', '.join(c.place for c in copies)})" if copies else "")
        + (f" at `{statement}`" if statement else "")
        + f": {error}\n--- traceback (end) ---\n{error_text[-4000:]}"
    )


def _run_group(first_line: str, cwd, data_dir: str) -> list[str | None]:
    """Runs every block that starts with `first_line` in one process in `cwd`: each one's
    traceback, or None where it ran through."""
    group = [run[0] for run in RUNS if run[0].first_line == first_line]
    os.symlink(os.path.join(ROOT, "configs"), cwd / "configs")
    prepared = PREPARED.get(first_line)
    paths = []
    for i, block in enumerate(group):
        code = block.code
        for written, run_as in prepared.replace if prepared else ():
            assert written in code, (
                f"{block.place}: the test runs this block with {written!r} replaced "
                f"by {run_as!r}, but the block no longer contains {written!r}"
            )
            code = code.replace(written, run_as)
        path = cwd / ".blocks" / str(i) / BLOCK_FILE
        path.parent.mkdir(parents=True)
        path.write_text(code, encoding="utf-8")
        paths.append(str(path))
    if prepared is not None:
        prepared.setup(str(cwd))
    env = dict(os.environ, JAX_PLATFORMS="cpu", TFJAX_DATA_DIR=data_dir)
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, *paths],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600 * len(paths),
    )
    if result.returncode or not (cwd / "failures.json").exists():  # the process itself failed
        return [f"exit status {result.returncode}\n{result.stderr}"] * len(paths)
    with open(cwd / "failures.json", encoding="utf-8") as f:
        return json.load(f)


# The blocks share the session's prepared datasets (conftest's data_dir); a stand-in trained in
# this process (the translation run) loads programs other tests compiled from the cache.
@pytest.mark.usefixtures("compilation_cache")
@pytest.mark.parametrize("run", RUNS, ids=lambda run: "+".join(b.place for b in run))
def test_block_runs_as_written(run, tmp_path_factory, data_dir, monkeypatch):
    block, *copies = run
    monkeypatch.setenv("TFJAX_DATA_DIR", data_dir)
    if block.first_line not in _GROUP_FAILURES:
        cwd = tmp_path_factory.mktemp("cwd")
        _GROUP_FAILURES[block.first_line] = _run_group(block.first_line, cwd, data_dir)
    group = [r[0] for r in RUNS if r[0].first_line == block.first_line]
    failure = _GROUP_FAILURES[block.first_line][group.index(block)]
    assert failure is None, _failure(block, failure, copies)


def test_import_tfjax_is_light_and_reaches_submodules_by_attribute():
    """`import tfjax` then `tfjax.runner.train.restore_model`, as the README writes it, without
    importing the data pipeline (or TensorFlow) until a submodule is asked for."""
    code = (
        "import sys, tfjax\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', "
        "'tensorflow_datasets', 'grain', 'jax')]\n"
        "assert not heavy, heavy\n"
        "assert 'tfjax.data' not in sys.modules\n"
        "assert callable(tfjax.runner.train.restore_model) and callable(tfjax.decode.generate)\n"
        "assert {'runner', 'nn', 'models', 'decode'} <= set(dir(tfjax)), dir(tfjax)\n"
        "runner = set(dir(tfjax.runner))\n"
        "assert {'train', 'setup', 'profiling', 'aot'} <= runner, runner\n"
        "for package in (tfjax, tfjax.runner):  # every listed name is a module that imports\n"
        "    for name in dir(package):\n"
        "        if not name.startswith('_'):\n"
        "            getattr(package, name)\n"
        "try:\n"
        "    tfjax.no_such_module\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_module' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('tfjax.no_such_module did not raise')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_failing_block_is_reported_at_its_page_and_line_and_the_next_still_runs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```bash\nls\n```\n\n```python\nx = 1\nraise ValueError('no')\n```\n")
    (block,) = readme_blocks(str(page), "docs/page.md")
    assert (block.line, block.first_line) == (8, "x = 1")
    paths = []
    for i, code in enumerate((block.code, "open('ran', 'w').close()\n")):
        path = tmp_path / str(i) / BLOCK_FILE
        path.parent.mkdir()
        path.write_text(code)
        paths.append(str(path))
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, *paths], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    failure, second = json.loads((tmp_path / "failures.json").read_text())
    message = _failure(block, failure, [Block(40, block.code)])
    assert message.startswith("docs/page.md:9: ") and "ValueError: no" in message, message
    assert "(its copies: README.md:40)" in message, message
    assert second is None and (tmp_path / "ran").exists()
