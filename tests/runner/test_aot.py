"""tfjax.runner.aot and experiments/compile.py: experiments compiled for TPU slices and GPU hosts on
this CPU host.

libtpu's compiler and JAX's CUDA plugin do the work (installed by `make test`); no TPU or GPU
is used. Each family's tiny preset compiles for v5e:2x2 on a (data, fsdp, tensor) mesh and
fits; an oversized program is refused with "DOES NOT FIT" and a non-zero exit, on a TPU and on
GPUs; two slices join on the data axis; one GPU node; bad input is refused before anything
compiles.
"""

import json
import time

import jax
import jax.numpy as jnp
import pytest
from conftest import run_python, set_fields

from tfjax.runner import aot, setup

MESH = {"data": 1, "fsdp": 2, "tensor": 2}


def tiny(spec: str, **overrides):
    config = setup.load_config(f"configs/{spec}")
    with config.unlocked():
        config.mesh.update(MESH)
        config.dtype = "bfloat16"
        config.model.scan_layers = True
        set_fields(config, overrides)
    return config


def compile_cli(*args, timeout=300):
    start = time.perf_counter()
    proc = run_python("experiments/compile.py", *args, timeout=timeout)
    return proc, time.perf_counter() - start


@pytest.mark.parametrize("spec", ["vit.py:tiny", "lm.py:tiny", "mlm.py:tiny", "translate.py:tiny"])
def test_each_family_compiles_for_v5e_and_fits(spec, v5e):
    report = aot.compile_experiment(tiny(spec), v5e, topology="v5e:2x2")
    assert report.mesh == MESH and report.fits
    assert report.hbm_bytes == 16 * 2**30 and report.peak_flops == 197e12
    names = [s.name for s in report.steps]
    assert names == (
        ["train", "eval", "decode"]
        if spec.split(":")[0] in ("lm.py", "translate.py")
        else ["train", "eval"]
    )
    train = report.steps[0]
    assert 0 < train.peak_bytes < report.hbm_bytes and train.argument_bytes > 0
    # fsdp and tensor parallelism: parameters are gathered, gradients reduced.
    assert train.collectives.get("all-gather", 0) > 0
    assert train.collectives.get("all-reduce", 0) + train.collectives.get("reduce-scatter", 0) > 0
    # bf16 end to end: no matmul of the step takes float32 operands.
    assert train.f32_dot_fraction == 0.0, train.f32_dot_fraction
    assert report.flops_per_step > 0 and report.ideal_step_s > 0
    assert not report.warnings, report.warnings
    text = aot.format_report(report)
    assert "of 16.00 GiB HBM" in text and "a lower bound" in text


def test_two_slices_join_on_the_data_axis():
    devices = aot.topology_devices("v5e:2x2", num_slices=2)
    assert len(devices) == 8 and {d.slice_index for d in devices} == {0, 1}
    config = tiny("lm.py:tiny", **{"mesh.data": -1, "mesh.fsdp": 2, "mesh.tensor": 1})
    report = aot.compile_experiment(config, devices, steps=("train",))
    assert report.mesh == {"data": 4, "fsdp": 2, "tensor": 1} and report.fits
    # Each slice holds a contiguous block of the data axis.
    from tfjax import sharding

    mesh = sharding.make_mesh(config.mesh, devices)
    first, second = mesh.devices[:2], mesh.devices[2:]
    assert {d.slice_index for d in first.flat} == {0} and {d.slice_index for d in second.flat} == {
        1
    }
    with pytest.raises(ValueError, match="the devices span 2 slice"):
        sharding.make_mesh(dict(config.mesh, dcn_data=1), devices)


def test_v4_compile_only_devices_make_a_mesh():
    """v4 topologies give one compile-only device per TensorCore (two per chip)."""
    devices = aot.topology_devices("v4:2x2x1")
    assert len(devices) == 8
    config = tiny("vit.py:tiny", **{"mesh.data": -1})
    report = aot.compile_experiment(config, devices, steps=("train",))
    assert report.fits and report.hbm_bytes == 16 * 2**30  # half of a 32 GiB chip


def test_too_big_does_not_fit_and_exits_non_zero():
    # A 8M-token vocabulary: 256M replicated parameters, and [16, 32, 8M] logits.
    proc, seconds = compile_cli(
        "--config=configs/lm.py:tiny",
        "--topology=v5e:2x2",
        "--steps=train",
        "--config.model.vocab_size=8388608",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "DOES NOT FIT: needs 20.00 GiB, the chip has 16.00 GiB" in proc.stdout
    assert "params/embed/embedding (8388608, 32) (1.00 GiB) is replicated" in proc.stdout
    assert "To fit:" in proc.stdout and "remat_policy" in proc.stdout
    assert seconds < 120


@pytest.mark.parametrize(
    "args, message",
    [
        (["--topology=v5e:4"], "accepted: TPU slices v4:AxBxC, v5e:AxB"),
        (["--topology=v7:2x2"], "unknown chip 'v7'"),
        (["--topology=h100:1x2x8"], "GPU targets are h100:N or h100:HxN"),
        (["--topology=h100:8", "--num_slices=2"], "num_slices applies to TPU slices"),
        (["--topology=v5e:2x2", "--platform=cuda"], "does not match topology 'v5e:2x2'"),
        (["--topology=v5e:2x2", "--config.mesh.fsdp=3"], "does not divide the 4 devices"),
        (
            ["--topology=v5e:2x2", "--config.mesh.data=2", "--config.mesh.fsdp=4"],
            "has 8 devices but there are 4",
        ),
        (["--topology=v5e:2x2", "--config.model.variant=nope"], "variant"),
        (
            ["--topology=v5e:2x2", "--json=/nonexistent/report.json"],
            "--json=/nonexistent/report.json: cannot be written (No such file or directory)",
        ),
    ],
)
def test_bad_input_is_refused_before_compiling(args, message):
    proc, _ = compile_cli("--config=configs/lm.py:tiny", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "train:" not in proc.stdout


def test_single_chip_slices_compile(tmp_path):
    """Slices smaller than libtpu's default host of 2x2 chips: v5e:1x1 (Colab's TPU), v6e:1x1.
    libtpu loads without its start-up errors (it finds no TPU slice on this host)."""
    config = tiny("lm.py:tiny", **{"mesh.fsdp": 1, "mesh.tensor": 1})
    report = aot.compile_experiment(config, aot.topology_devices("v6e:1x1"), steps=("eval",))
    assert report.devices.startswith("1 x TPU v6 lite") and report.fits
    path = tmp_path / "report.json"
    proc, _ = compile_cli(
        "--config=configs/lm.py:tiny", "--topology=v5e:1x1", "--steps=eval", f"--json={path}"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    written = json.loads(path.read_text())
    assert written["num_devices"] == 1 and written["fits"] and written["steps"][0]["name"] == "eval"
    assert "TPU_WORKER_HOSTNAMES" not in proc.stderr and "host bounds" not in proc.stderr


def test_a_misspelt_key_names_the_key():
    proc, _ = compile_cli(
        "--config=configs/lm.py:tiny", "--topology=v5e:2x2", "--config.model.widht=64"
    )
    assert proc.returncode != 0 and "widht" in proc.stderr


def test_collectives_in_loops_count_once_per_trip():
    hlo = """
%cond (p: (s32[])) -> pred[] {
  %p = (s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(12)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[])) -> (s32[]) {
  %ag = bf16[1024,256]{1,0} all-gather(bf16[512,256]{1,0} %x), dimensions={0}
  ROOT %t = (s32[]) tuple(%i)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[]) while(%init), condition=%cond, body=%body
  %ar = f32[1000]{0} all-reduce(f32[1000]{0} %g), to_apply=%add
  ROOT %r = f32[8] copy(%a)
}
"""
    got = aot.collective_bytes(hlo)
    assert got == {"all-gather": 12 * 1024 * 256 * 2, "all-reduce": 4000}


def test_f32_dot_fraction():
    def dots(a, b, c, d):  # [64, 32] @ [32, 64] in float32 and mixed, [64, 96] @ [96, 64] in bf16
        mixed = jnp.dot(a, b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return a @ b + mixed + jnp.dot(c, d, preferred_element_type=jnp.float32)

    shapes = [
        ((64, 32), jnp.float32),
        ((32, 64), jnp.float32),
        ((64, 96), jnp.bfloat16),
        ((96, 64), jnp.bfloat16),
    ]
    lowered = jax.jit(dots).lower(*(jax.ShapeDtypeStruct(*s) for s in shapes))
    assert aot.f32_dot_fraction(lowered.as_text()) == pytest.approx(64 / (64 + 96))


def test_a_gpu_node_compiles_and_fits():
    devices = aot.topology_devices("h100:4", platform="cuda")
    assert len(devices) == 4 and devices[0].device_kind == "NVIDIA H100 80GB HBM3"
    report = aot.compile_experiment(tiny("translate.py:tiny"), devices, topology="h100:4")
    assert (
        report.mesh == MESH
        and report.fits
        and [s.name for s in report.steps] == ["train", "eval", "decode"]
    )
    # JAX's GPU client allocates from 75% of the memory (XLA_PYTHON_CLIENT_MEM_FRACTION).
    assert report.hbm_bytes == int(0.75 * 81_559 * 2**20) and report.peak_flops == 989e12
    train = report.steps[0]
    assert 0 < train.peak_bytes < report.hbm_bytes and train.f32_dot_fraction == 0.0
    assert train.collectives.get("all-gather", 0) > 0
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in aot.format_report(report)


def test_too_big_for_a_gpu_does_not_fit():
    """The GPU compiler accepts any size; tfjax compares the peak with what JAX may allocate."""
    proc, seconds = compile_cli(
        "--config=configs/lm.py:tiny",
        "--topology=h100:2",
        "--steps=train",
        "--config.model.vocab_size=33554432",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "DOES NOT FIT: needs" in proc.stdout and "the chip has 59.74 GiB" in proc.stdout
    assert seconds < 120


def test_the_host_stays_on_the_cpu():
    assert jax.default_backend() == "cpu"


def test_beam_search_on_a_data_parallel_mesh_gathers_nothing(v5e):
    """Beams are reordered within each row, so the sharded KV cache is never all-gathered."""
    config = tiny(
        "translate.py:tiny",
        **{"mesh.data": 4, "mesh.fsdp": 1, "mesh.tensor": 1, "decode.method": "beam"},
    )
    report = aot.compile_experiment(config, v5e, steps=("decode",))
    assert report.fits and report.steps[0].collectives == {}
