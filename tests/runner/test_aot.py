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


# libtpu 0.0.50.1's words, from compiles of the 8B train step (benchmarks/maxtext/fit.py).
HBM_REFUSAL = (
    "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory "
    "required for HLO temporaries (96.53G) exceeds available HBM (95.73G). HLO module: "
    "jit_train_step."
)
VMEM_REFUSAL = "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: "


def test_only_an_hbm_refusal_says_the_batch_does_not_fit():
    assert aot.refused_for_memory(HBM_REFUSAL)
    assert aot.refused_bytes(HBM_REFUSAL) == int(96.53 * 2**30)
    # A kernel over its VMEM is refused at any batch: a compiler failure that names the flag.
    assert not aot.refused_for_memory(VMEM_REFUSAL)
    assert "--xla_tpu_scoped_vmem_limit_kib" in aot.vmem_hint(VMEM_REFUSAL)
    assert aot.vmem_hint(HBM_REFUSAL) == ""


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


def test_collectives_after_a_multi_line_attribute_are_counted():
    """A kernel's attributes may span lines and close with `}}` at a line's start (the splash
    attention kernel's metadata): the computation goes on after it. Braces in strings do not
    count."""
    hlo = r"""HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %k = f32[8]{0} custom-call(%a), custom_call_target="kernel", frontend_attributes={meta={
"xprof_metadata":"{\"block_q\": 512, \"odd\": \"}}\"}"
}}, backend_config={"custom_call_config":{"body":"a{b"}}
  %ag = f32[64]{0} all-gather(%k), dimensions={0}
  ROOT %r = f32[8]{0} copy(%a)
}
"""
    assert aot.collective_bytes(hlo) == ({"all-gather": 64 * 4}, [])


def test_a_gather_written_as_an_all_reduce_is_named_so():
    """XLA:TPU writes some gathers (FSDP's on 64 chips) as an all-reduce of zeros with each
    device's shard written in, directly or in a fusion: counted as "all-gather (as
    all-reduce)", the rest of the same all-reduce (a gradient's sum) as "all-reduce"."""
    hlo = """HloModule m

%place (base: bf16[32,8], piece: bf16[4,8], at: s32[]) -> bf16[32,8] {
  %base = bf16[32,8]{1,0} parameter(0)
  %piece = bf16[4,8]{1,0} parameter(1)
  %at = s32[] parameter(2)
  ROOT %placed = bf16[32,8]{1,0} dynamic-update-slice(%base, %piece, %at, %at)
}

ENTRY %main (shard: bf16[4,8], grad: f32[16]) -> f32[16] {
  %shard = bf16[4,8]{1,0} parameter(0)
  %grad = f32[16]{0} parameter(1)
  %zero = bf16[] constant(0)
  %zeros = bf16[32,8]{1,0} broadcast(%zero), dimensions={}
  %at = s32[] partition-id()
  %placed = bf16[32,8]{1,0} dynamic-update-slice(%zeros, %shard, %at, %at)
  %moved = bf16[32,8]{1,0} copy(%placed)
  %fused = bf16[32,8]{1,0} fusion(%zeros, %shard, %at), kind=kLoop, calls=%place
  %sums = (bf16[32,8]{1,0}, bf16[32,8]{1,0}, f32[16]{0}) all-reduce(%moved, %fused, %grad)
  ROOT %r = f32[16]{0} get-tuple-element(%sums), index=2
}
"""
    got = aot.collective_bytes(hlo)
    assert got == ({"all-gather (as all-reduce)": 2 * 32 * 8 * 2, "all-reduce": 16 * 4}, [])


def test_loop_trip_counts():
    """Each loop's collectives count once per trip: XLA's known_trip_count, else the induction
    variable's start, step and bound (a windowed einsum's counter steps by 2; a decode loop
    also stops early, and counts to its bound); a loop whose count cannot be read counts once
    and is named."""
    hlo = """HloModule m

%by2_cond (p: (s32[])) -> pred[] {
  %p = (s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%by2_body (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %two = s32[] constant(2)
  %next = s32[] add(%i, %two)
  %ag = bf16[1024]{0} all-gather(bf16[256]{0} %x), dimensions={0}
  ROOT %t = (s32[]) tuple(%next)
}

%kn_cond (p: (s32[], s32[])) -> pred[] {
  %p = (s32[], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=1
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%kn_body (p: (s32[], s32[])) -> (s32[], s32[]) {
  %p = (s32[], s32[]) parameter(0)
  %ar = f32[100]{0} all-reduce(f32[100]{0} %g), to_apply=%add
  ROOT %t = (s32[], s32[]) tuple(%i, %n)
}

%down_cond (p: (s32[], pred[])) -> pred[] {
  %p = (s32[], pred[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %four = s32[] constant(4)
  %more = pred[] compare(%four, %i), direction=LT
  %done = pred[] get-tuple-element(%p), index=1
  %going = pred[] not(%done)
  ROOT %and = pred[] and(%more, %going)
}

%down_body (p: (s32[], pred[])) -> (s32[], pred[]) {
  %p = (s32[], pred[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] subtract(%i, %one)
  %cp = f32[10]{0} collective-permute(f32[10]{0} %y), source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], pred[]) tuple(%next, %done)
}

%opaque_body (p: (s32[], s32[])) -> (s32[], s32[]) {
  %p = (s32[], s32[]) parameter(0)
  %g = f32[64]{0} parameter(1)
  %rs = f32[16]{0} reduce-scatter(%g), dimensions={0}, to_apply=%add
  ROOT %t = (s32[], s32[]) tuple(%i, %n)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %ten = s32[] constant(10)
  %no = pred[] constant(false)
  %n = s32[] parameter(1)
  %by2_init = (s32[]) tuple(%zero)
  %by2 = (s32[]) while(%by2_init), condition=%by2_cond, body=%by2_body
  %kn_init = (s32[], s32[]) tuple(%zero, %n)
  %kn = (s32[], s32[]) while(%kn_init), condition=%kn_cond, body=%kn_body, KNOWN
  %ten_copy = s32[] copy(%ten)
  %down_init = (s32[], pred[]) tuple(%ten_copy, %no)
  %down = (s32[], pred[]) while(%down_init), condition=%down_cond, body=%down_body
  %opaque = (s32[], s32[]) while(%kn_init), condition=%kn_cond, body=%opaque_body
  ROOT %r = f32[8]{0} copy(%a)
}
""".replace("KNOWN", 'backend_config={"known_trip_count":{"n":"5"}}')
    got, counted_once = aot.collective_bytes(hlo)
    assert got == {
        "all-gather": 4 * 1024 * 2,  # i = 0, 2, 4, 6 (the old reading took 8 trips: the bound)
        "all-reduce": 5 * 100 * 4,  # known_trip_count; the bound is a runtime value
        "collective-permute": 6 * 10 * 4,  # i = 10 down to 5 (4 < i), or sooner when done
        "reduce-scatter": 64 * 4,  # once: its operand, the array reduced
    }
    assert counted_once == ["opaque_body"]


def test_fsdp_collective_matmuls_are_reported_as_gathers_and_reduce_scatters():
    """XLA:TPU does FSDP's weight gathers and gradient reduce-scatters of a decoder on 8 chips
    as collective matmuls: loops of collective-permutes that pass each 1/8 shard of a weight
    around the ring. Their bytes are counted by hand from the parameter shapes."""
    config = tiny(
        "lm.py:tiny",
        **{
            "mesh.fsdp": 8,
            "mesh.tensor": 1,
            "model.width": 256,
            "model.mlp_dim": 1024,
            "model.max_len": 256,
            "dataset.seq_len": 256,
            "batch_size": 32,  # 1,024 tokens per chip: enough for the compiler to window
        },
    )
    start = time.perf_counter()
    report = aot.compile_experiment(config, aot.topology_devices("v5p:2x2x2"), steps=("train",))
    seconds = time.perf_counter() - start
    train = report.steps[0]
    assert report.mesh == {"data": 1, "fsdp": 8, "tensor": 1} and report.fits
    # Per layer (2 layers, bf16): query, key, value and output 256 x 256, MLP 256 x 1024 and
    # 1024 x 256. Each windowed loop passes a 1/8 shard 9 times: once before it (all-gather)
    # or after it (reduce-scatter), and 4 times per trip (2 hops each way round the ring) for
    # 2 trips (its counter steps by 2 up to 4), so 9/8 of the array.
    weights = 2 * (4 * 256 * 256 + 2 * 256 * 1024) * 2
    assert train.collectives["all-gather (collective matmul)"] == 2 * weights * 9 / 8  # forward
    # and the backward pass's input gradients each gather every weight once
    embedding = 384 * 256 * 2  # the tied output layer's gradient: 256 bytes + specials, x128
    assert train.collectives["reduce-scatter (collective matmul)"] == (weights + embedding) * 9 / 8
    assert "collective-permute" not in train.collectives  # every permute is one of those
    assert train.loops_counted_once == [] and not report.warnings
    assert "all-gather (collective matmul) 0.01 GiB" in aot.format_report(report)
    assert seconds < 120


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
    # The GPU compiler fuses the decode loop's condition (beam search's counter is compared
    # inside a fusion): its trip count is not read, so its collectives count once, and the
    # report says so instead of guessing.
    (warning,) = report.warnings
    assert warning.startswith("decode step: collectives counted once in 1 while loop(s) whose")
    assert report.steps[2].loops_counted_once and not train.loops_counted_once


def test_too_big_for_a_gpu_does_not_fit():
    """The GPU compiler accepts any size; tfjax compares the peak with what JAX may allocate."""
    proc, seconds = compile_cli(
        "--config=configs/lm.py:tiny",
        "--topology=h100:2",
        "--steps=train",
        # a 64M-token vocabulary: at 32M the peak fell from 76.0 to 48.0 GiB with the loss's
        # and the head's memory fixes (tfjax.tasks.losses, tfjax.ops.head), under 59.74 GiB
        "--config.model.vocab_size=67108864",
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


def test_fsdp_decode_gathers_the_weights_once_per_call():
    """Decoding from FSDP-sharded parameters on v5p:2x2x2: laid out once per call (bf16,
    replicated) the program all-gathers one bf16 copy of the model, however many tokens it
    generates; split over the mesh ("tensor") its token loop moves activations only; read as
    given, every generated token gathers the whole model again."""
    devices = aot.topology_devices("v5p:2x2x2")
    fields = {
        "mesh.data": 1,
        "mesh.fsdp": 8,
        "mesh.tensor": 1,
        "model.width": 256,
        "model.num_heads": 8,
        "model.mlp_dim": 1024,
        "model.max_len": 256,
    }
    moved = {}
    for layout in ("auto", "tensor", "as-given"):
        for n in (16, 48):
            config = tiny(
                "lm.py:tiny", **fields, **{"decode.layout": layout, "decode.max_new_tokens": n}
            )
            report = aot.compile_experiment(config, devices, steps=("decode",))
            (decode,) = report.steps
            assert report.fits and decode.loops_counted_once == []
            moved[layout, n] = decode.collectives
    # Per layer (2): query, key, value, output 256 x 256, MLP 256 x 1024 and 1024 x 256; the
    # tied embedding 384 x 256 (tiny's vocabulary): the kernels every token reads, in bf16.
    copy = (2 * (4 * 256 * 256 + 2 * 256 * 1024) + 384 * 256) * 2
    gathered = moved["auto", 16].get("all-gather", 0)
    assert copy <= gathered <= 1.1 * copy  # the norms, biases and positions stay float32
    assert moved["auto", 48]["all-gather"] == gathered  # once per call, not per token

    def per_token(layout):
        a, b = moved[layout, 16], moved[layout, 48]
        return sum(b.get(k, 0) - a.get(k, 0) for k in b) / 32

    assert per_token("auto") < 0.001 * copy  # a few scalars a token
    assert per_token("tensor") < 0.02 * copy  # activations: [rows, 1, 256] a layer
    assert per_token("as-given") >= copy  # the whole model again for every token
