r"""Writes a run as a Hugging Face checkpoint directory that `transformers` loads, or a LoRA
run's adapters as a directory that `peft` loads onto the checkpoint the run started from.

    python experiments/export.py --workdir=/tmp/ft --output=/tmp/ft_hf [--step=N]
    python experiments/export.py --workdir=/tmp/ft --output=/tmp/ft_lora --adapters_only
    python experiments/export.py --workdir=/tmp/ft --output=/tmp/ft_hf --config.init_from=NEW_DIR

The run's config is read from the workdir (config.json), the newest checkpoint (or --step) is
exported with its family's converter (`tfjax.interop`): config.json with the special token ids,
generation_config.json, model.safetensors (sharded with an index above 5 GB; LoRA adapters
merged) and the tokenizer files of the checkpoint the run started from. With --adapters_only:
adapter_config.json and adapter_model.safetensors (peft's LoRA format, base_model_name_or_path
= the run's config.init_from) and the tokenizer files, for

    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(init_from), "/tmp/ft_lora")

which computes what the full export does; refused (status 1, one line) for a run without LoRA,
a QLoRA run (lora.base_dtype: no base peft loads is the quantized one its adapters were trained
on; the full export is that model), one that did not start from a Hugging Face checkpoint
directory (or whose init_from has moved), and an adapted kernel that is not one Linear or
Conv1D layer's matmul in the checkpoint (GPT-2's Conv1D layers and fused c_attn take adapters).

A LoRA run's base is loaded again from the run's config.init_from; when that checkpoint has
moved, --config.init_from gives its new place (as for experiments/run.py and decode.py), checked
to be the same base. --output must not exist, and is written whole or not at all: into a
hidden directory beside it, renamed at the end (one that an export killed part-way left is
removed by the next export there); a read-only or full file system is one line naming it.
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfjax.runner import startup  # noqa: E402 - imports no JAX

startup.choose_platform()  # before anything imports JAX

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory.")
_OUTPUT = flags.DEFINE_string("output", None, "The Hugging Face directory to write (new).")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint step to export (default: newest).")
_ADAPTERS_ONLY = flags.DEFINE_bool(
    "adapters_only",
    False,
    "A LoRA run's adapters alone, as a peft adapter directory for the Hugging Face checkpoint "
    "in the run's config.init_from (default: the whole model, adapters merged).",
)
_INIT_FROM = flags.DEFINE_string(
    "config.init_from",
    None,
    "Where the checkpoint the run started from is now, when it has moved since the run "
    "(default: the run's config.init_from).",
)
flags.mark_flags_as_required(["workdir", "output"])


def main(argv):
    from tfjax.runner import checkpoint, export

    startup.show_own_info_only()
    if len(argv) > 1:
        print(f"export.py: unexpected arguments: {argv[1:]}", file=sys.stderr)
        return 2
    try:
        path = export.export_run(
            _WORKDIR.value,
            _OUTPUT.value,
            step=_STEP.value,
            adapters_only=_ADAPTERS_ONLY.value,
            init_from=_INIT_FROM.value,
        )
    except (
        ValueError,
        export.ExportWriteError,  # --output's file system: read-only, full, no permission
        FileNotFoundError,
        FileExistsError,
        NotADirectoryError,
        checkpoint.CheckpointError,  # unusable, mismatched or unreadable steps
    ) as e:  # tfjax's checks of the workdir, its checkpoints and the export: the message says it
        print(f"export.py: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    app.run(main)
