"""experiments/export.py when things go wrong: what it refuses and why (a QLoRA run's adapters
alone).
"""

import json
import os

import pytest

from tfjax.runner import export


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
