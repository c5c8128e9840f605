r"""Compiles an experiment for a TPU slice or GPU hosts from this host: does it fit, and what
will it cost?

    python experiments/compile.py --config=configs/lm.py:gpt2-small --topology=v5e:4x4 \
        [--num_slices=2] [--config.model.remat_policy=dots ...] [--json=report.json]
    python experiments/compile.py --config=configs/lm.py:gpt2-small --topology=h100:8

No data, workdir or accelerator is needed: for a TPU, libtpu; for a GPU, JAX's CUDA plugin and
ptxas (`make install-dev` installs all three). For each step of the config (train, eval, and
decode for generating tasks) it prints the mesh and per-device batch, parameter and optimizer
bytes per device, compile time, memory (arguments, temporaries, peak) against the chip's HBM
(on a GPU, the 75% of it JAX allocates from), model FLOPs per step and the ideal step time at
the chip's peak bf16 rate (a lower bound), and collective bytes per step by kind; it warns on
a large replicated array, float32 matmuls under a bf16 config, a peak above 90% of HBM, and
collectives in a loop whose trip count it cannot read (see tfjax.runner.aot for how each is
measured).

Exit status: 0 when every step fits, 1 when one does not ("DOES NOT FIT: needs X GiB, the chip
has Y", with what to change), 2 for bad input (an unknown topology, a mesh that does not match
the devices, a config error, a --json path that cannot be written), reported before anything
is compiled; 3 when the compiler itself fails on a step (its first line is printed).

A slice smaller than a host compiles too: v5e:1x1 and v6e:1x1 (Colab's TPU is a v5e:1x1).

--save=DIR also writes the executables a run starts with (the state's initialisation, the train
and eval steps), with what they were compiled for, when every step fits; the runner loads them
with --config.compiled_dir=DIR when the config, the topology and the versions match, and says
what differs when they do not (see tfjax.runner.executables). --topology=cpu:N compiles for N
of this host's CPU devices, so that what is saved runs here. DIR must be new, empty or an
earlier save (checked first, status 2).
"""

import json
import os
import sys

# Compile-only: the host computes nothing, and must not try to start a TPU backend of its own.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/<family>.py[:preset,...]).", lock_config=True
)
_TOPOLOGY = flags.DEFINE_string(
    "topology",
    None,
    "TPU slice (v4:AxBxC, v5e:AxB, v5p:AxBxC, v6e:AxB, e.g. v5e:4x4) or GPU "
    "hosts (a100:N, h100:N, h200:N; h100:HxN for H hosts).",
)
_PLATFORM = flags.DEFINE_enum(
    "platform", None, ["tpu", "cuda"], "Optional: the topology's platform, checked against it."
)
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices joined by DCN (data parallel).")
_STEPS = flags.DEFINE_list("steps", ["train", "eval", "decode"], "Which steps to compile.")
_JSON = flags.DEFINE_string("json", None, "Also write the report as JSON to this path.")
_SAVE = flags.DEFINE_string(
    "save",
    None,
    "Also write the init, train and eval executables and their manifest to this directory, "
    "for the runner's --config.compiled_dir.",
)
flags.mark_flags_as_required(["config", "topology"])


def main(argv):
    del argv
    from tfjax.runner import aot

    unknown = sorted(set(_STEPS.value) - {"train", "eval", "decode"})
    if unknown:
        print(f"--steps: unknown {unknown}; allowed: train, eval, decode", file=sys.stderr)
        return 2
    if _JSON.value and (problem := _unwritable(_JSON.value)):
        print(f"--json={_JSON.value}: {problem}", file=sys.stderr)
        return 2
    if _SAVE.value:
        from tfjax.runner import executables

        if not {"train", "eval"} & set(_STEPS.value):
            print(
                f"--save: --steps={','.join(_STEPS.value)} has nothing to save; add train or eval",
                file=sys.stderr,
            )
            return 2
        try:
            executables.check_save_dir(_SAVE.value)
        except executables.SavedExecutablesError as e:
            print(e, file=sys.stderr)
            return 2
    config = _CONFIG.value
    spec = config_flags.get_config_filename(flags.FLAGS["config"])
    overrides = config_flags.get_override_values(flags.FLAGS["config"])
    name = spec + "".join(f" --config.{k}={v}" for k, v in sorted(overrides.items()))
    try:
        devices = aot.topology_devices(
            _TOPOLOGY.value, num_slices=_NUM_SLICES.value, platform=_PLATFORM.value
        )
        topology = _TOPOLOGY.value
        if _NUM_SLICES.value > 1:
            topology += f" x {_NUM_SLICES.value} slices"
        report = aot.compile_experiment(
            config,
            devices,
            topology=topology,
            name=name,
            steps=tuple(_STEPS.value),
            save_to=_SAVE.value,
        )
    except aot.CompileError as e:
        print(f"{name} on {_TOPOLOGY.value}: {e}", file=sys.stderr)
        return 3
    except (ValueError, RuntimeError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    print(aot.format_report(report))
    if _SAVE.value:
        print(
            f"  saved to {_SAVE.value}: {', '.join(os.path.basename(p) for p in report.saved)}"
            if report.saved
            else f"  nothing saved to {_SAVE.value}: a step does not fit"
        )
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(report.as_dict(), f, indent=2)
    return 0 if report.fits else 1


def _unwritable(path: str) -> str | None:
    """Why `path` cannot be written (None: it can), found by opening it to append, which
    changes nothing in a file that exists; one this creates is removed again."""
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return f"cannot be written ({e.strerror})"
    if not existed:
        os.remove(path)
    return None


if __name__ == "__main__":
    app.run(main)
