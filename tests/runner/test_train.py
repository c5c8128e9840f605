"""End-to-end runs of tfjax.runner.train on 8 simulated CPU devices: meshes, resume, bad input."""

import hashlib
import json
import logging
import math
import os
import signal
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, listed_steps, run_command, set_fields
from jax.sharding import PartitionSpec as P

from tfjax.runner import metrics, train

# A resumed run, and the same programs in other tests, load them from the compilation cache.
pytestmark = pytest.mark.usefixtures("compilation_cache")


def lm_config(data_dir, **overrides):
    """The tiny causal-LM config (tensor parallelism has heads, MLP and vocab to split) with
    dropout on, so that the test also covers per-step randomness across meshes. One layer: what
    is split and how is the same in each layer, and every run's programs compile in a third
    less time. Evaluation writes no samples (what it decodes is tested in
    tests/runner/test_decode_runner.py): no run here reads them, and each would compile a
    generation program for its mesh."""
    config = train.load_config(os.path.join(ROOT, "configs/lm.py:tiny"))
    config.data_dir = data_dir
    config.model.update(num_layers=1, dropout_rate=0.1)
    config.update(num_train_steps=10, log_every=1, eval_every=0, eval_steps=1)
    config.checkpoint.every = 0
    config.decode.num_samples = 0
    return set_fields(config, overrides)


def losses(workdir, split="train"):
    return [(r["step"], r["loss"]) for r in metrics.read_metrics(workdir, split)]


def snapshot(directory):
    """{relative path: sha256} of every file below directory."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


MESHES = {
    "1 device": (dict(data=1, fsdp=1, tensor=1), 1),
    "data=8": (dict(data=8, fsdp=1, tensor=1), 8),
    "fsdp=8": (dict(data=1, fsdp=8, tensor=1), 8),
    "2x2x2": (dict(data=2, fsdp=2, tensor=2), 8),
}


def mesh_config(data_dir, name):
    """lm_config on mesh MESHES[name], with a moving average of the parameters in the state
    (test_resume_continues_exactly resumes the data=8 run's config: the average is part of
    the state a resumed run must restore)."""
    mesh, _ = MESHES[name]
    config = lm_config(data_dir, **{f"mesh.{k}": v for k, v in mesh.items()})
    config.optim.ema_decay = 0.9
    return config


@pytest.fixture(scope="module")
def mesh_runs(data_dir, tmp_path_factory):
    runs = {}
    for name, (_, n) in MESHES.items():
        workdir = str(tmp_path_factory.mktemp("mesh"))
        result = train.train_and_evaluate(
            mesh_config(data_dir, name), workdir, devices=jax.devices()[:n]
        )
        runs[name] = (workdir, result)
    return runs


def test_meshes_give_the_same_losses(mesh_runs):
    reference = losses(mesh_runs["1 device"][0])
    assert [s for s, _ in reference] == list(range(1, 11))
    assert reference[-1][1] < reference[0][1]  # it learns
    for name, (workdir, _) in mesh_runs.items():
        got = losses(workdir)
        assert [s for s, _ in got] == [s for s, _ in reference], name
        np.testing.assert_allclose(
            [v for _, v in got], [v for _, v in reference], rtol=1e-5, err_msg=name
        )


@pytest.mark.parametrize(
    "name, spec, shard_shape",
    [
        ("1 device", P("fsdp", "tensor"), (32, 64)),
        ("data=8", P("fsdp", "tensor"), (32, 64)),  # replicated: parameters are not split
        ("fsdp=8", P("fsdp", "tensor"), (4, 64)),  # embed over fsdp
        ("2x2x2", P("fsdp", "tensor"), (16, 32)),  # embed over fsdp, mlp over tensor
    ],
)
def test_parameters_are_sharded_by_the_rules(mesh_runs, name, spec, shard_shape):
    params = mesh_runs[name][1]["state"].params
    kernel = params["decoder"]["layers_0"]["mlp"]["wi"]["kernel"]  # [embed, mlp] = [32, 64]
    assert kernel.shape == (32, 64)
    assert kernel.sharding.spec == spec
    assert {s.data.shape for s in kernel.addressable_shards} == {shard_shape}
    # Adam's moments are laid out like the parameters they belong to.
    adam = mesh_runs[name][1]["state"].opt_state
    mu = [x for x in jax.tree.leaves(adam) if x.shape == (32, 64)]
    assert mu and all(m.sharding.spec == spec for m in mu)


def test_resume_continues_exactly(data_dir, mesh_runs, tmp_path):
    """Stopped after step 5 and run again, a run ends as the straight run of the same config
    on the same mesh (mesh_runs' data=8, whose programs the compilation cache holds)."""
    straight, expected = mesh_runs["data=8"]
    config = mesh_config(data_dir, "data=8")
    config.checkpoint.every = 5
    resumed = str(tmp_path / "resumed")
    first = train.train_and_evaluate(config, resumed, stop_after_step=5)
    assert first["step"] == 5 and [s for s, _ in losses(resumed)] == list(range(1, 6))
    second = train.train_and_evaluate(config, resumed)  # the same command again
    assert second["step"] == 10

    assert losses(resumed) == losses(straight)  # steps 1-5 from the first run, 6-10 resumed
    for name in ("params", "ema_params"):  # the average is part of the state that must resume
        same = jax.tree.map(
            lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
            getattr(expected["state"], name),
            getattr(second["state"], name),
        )
        assert all(jax.tree.leaves(same)), name
    with open(os.path.join(resumed, "config.json")) as f:
        assert json.load(f)["num_train_steps"] == 10


def test_gradient_accumulation_matches_one_batch():
    """num_microbatches=2 makes the same update as one batch (losses are summed, then divided
    once by the weight of the whole batch)."""
    import ml_collections

    from tfjax import sharding, tasks
    from tfjax.models import decoder
    from tfjax.runner import optim, setup, steps

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.DEFAULT_RULES
    model = decoder.Model("tiny", vocab_size=64, num_layers=1)
    # SGD: the update is linear in the gradient (Adam's first step is ~lr * sign(g), which
    # turns rounding-level differences of near-zero gradients into lr-sized ones).
    oc = ml_collections.ConfigDict(
        dict(
            name="sgd",
            learning_rate=0.5,
            schedule="constant",
            warmup_steps=0,
            end_learning_rate_fraction=0.0,
            b1=0.0,
            b2=0.0,
            eps=0.0,
            weight_decay=0.0,
            grad_clip_norm=0.0,
            ema_decay=0.0,
        )
    )
    tx = optim.make_optimizer(oc, d_model=32, num_train_steps=1)
    task = tasks.get("lm")
    spec = {
        "tokens": jax.ShapeDtypeStruct((16, 12), np.int32),
        "weights": jax.ShapeDtypeStruct((16, 12), np.float32),
    }
    init_fn, abstract, _ = setup.abstract_train_state(
        model, tx, task, spec, mesh=mesh, rules=rules, ema=False
    )
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    tokens = np.random.default_rng(0).integers(1, 64, (16, 12)).astype(np.int32)
    tokens[3, 7:] = 0  # some padding: rows carry different weights
    weights = (tokens != 0).astype(np.float32)
    batch = sharding.shard_batch({"tokens": tokens, "weights": weights}, mesh, rules)
    out = {}
    for m in (1, 2):
        step = jax.jit(
            steps.make_train_step(model, task, tx, mesh=mesh, rules=rules, num_microbatches=m)
        )
        state = jax.jit(init_fn, out_shardings=shardings)(jax.random.key(0))
        out[m] = step(state, batch, jax.random.key(1))
    np.testing.assert_allclose(out[2][1]["loss"], out[1][1]["loss"], rtol=1e-6)
    assert float(out[2][1]["weight"]) == float(out[1][1]["weight"]) == 16 * 11 - 5
    for a, b in zip(
        jax.tree.leaves(out[2][0].params), jax.tree.leaves(out[1][0].params), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def finished_run(mesh_runs):
    """A finished run (10 steps, data=8) whose workdir the bad-input tests try to reuse."""
    return mesh_runs["data=8"]


def rerun_config(data_dir, **overrides):
    """The finished run's config (moving average included), 4 steps, with `overrides`."""
    return lm_config(data_dir, num_train_steps=4, **{"optim.ema_decay": 0.9, **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mesh.fsdp": 3}, "does not divide the 8 devices"),
        ({"mesh.data": 2, "mesh.fsdp": 2}, "has 4 devices but there are 8"),
        ({"batch_size": 12}, "batch_size=12 is not divisible by 8"),
        ({"num_microbatches": 4}, "num_microbatches=4"),
        ({"model.width": 48}, r"parameter 'decoder/final_norm/bias' has shape \(32,\) there"),
        ({"optim.name": "adam"}, "optim.name must be one of \\('adamw', 'sgd'\\), got 'adam'"),
        ({"logical_axis_rules": (("embed", "model"),)}, "mesh axis 'model'"),
    ],
)
def test_bad_input_stops_before_training_and_changes_nothing(
    data_dir, finished_run, overrides, message
):
    finished_run, _ = finished_run
    before = snapshot(finished_run)
    config = rerun_config(data_dir, **{"mesh.data": -1, **overrides})
    with pytest.raises(ValueError, match=message):
        train.train_and_evaluate(config, finished_run)
    assert snapshot(finished_run) == before


def test_incompatible_checkpoint_names_the_parameter(data_dir, finished_run):
    finished_run, _ = finished_run
    before = snapshot(finished_run)
    config = rerun_config(data_dir, **{"model.mlp_dim": 128})
    with pytest.raises(ValueError, match=r"'decoder/layers_0/mlp/wi/(bias|kernel)'.*\(128"):
        train.train_and_evaluate(config, finished_run)
    config = rerun_config(data_dir, **{"model.num_layers": 2})
    with pytest.raises(ValueError, match="'decoder/layers_1/.*' .* is not in it"):
        train.train_and_evaluate(config, finished_run)
    assert snapshot(finished_run) == before


def test_init_from_takes_parameters_only(data_dir, finished_run, tmp_path):
    finished_run, source = finished_run
    source = source["state"].params
    config = lm_config(data_dir, num_train_steps=1, init_from=finished_run)
    # A zero learning rate: the one step leaves the parameters as loaded.
    config.optim.update(schedule="constant", warmup_steps=0, learning_rate=0.0)
    result = train.train_and_evaluate(config, str(tmp_path / "new"))
    assert result["step"] == 1  # a new run: the step count starts over
    same = jax.tree.map(
        lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), source, result["state"].params
    )
    assert all(jax.tree.leaves(same))


def test_evaluation_logs_its_throughput(data_dir, tmp_path, caplog):
    config = set_fields(
        train.load_config(os.path.join(ROOT, "configs/vit.py:tiny")),
        {"data_dir": data_dir, "num_train_steps": 2, "eval_steps": 2},
    )
    with caplog.at_level(logging.INFO):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    [line] = [r.getMessage() for r in caplog.records if "Evaluation at step 2" in r.getMessage()]
    batch = config.eval_batch_size
    assert f": {2 * batch} examples in " in line and " examples/s)" in line


# ------------------------------------------------------------------------ mixture of experts
# configs/lm.py:moe-tiny (8 experts, 2 per token, experts on the fsdp axis) on one device and
# on 8 with data, expert (fsdp) and tensor parallelism together; no z-loss on the logits, so
# that the logged loss is the cross-entropy plus the experts' weighted losses alone. One layer
# (of the preset's two): the runs' programs compile in less time, each layer's experts alike.
MOE_MESHES = {
    "1 device": (dict(data=1, fsdp=1, tensor=1), 1),
    "2x2x2": (dict(data=2, fsdp=2, tensor=2), 8),
}
MOE_FIELDS = {
    "num_train_steps": 6,
    "log_every": 1,
    "eval_every": 0,
    "eval_steps": 1,
    "checkpoint.every": 0,
    "decode.num_samples": 0,
    "loss.z_loss": 0.0,
    "model.num_layers": 1,
}


def moe_config(data_dir, mesh_name, **overrides):
    config = train.load_config(os.path.join(ROOT, "configs/lm.py:moe-tiny"))
    mesh, _ = MOE_MESHES[mesh_name]
    fields = {"data_dir": data_dir, **MOE_FIELDS, **{f"mesh.{k}": v for k, v in mesh.items()}}
    return set_fields(config, {**fields, **overrides})


@pytest.fixture(scope="module")
def moe_runs(data_dir, tmp_path_factory):
    runs = {}
    for name, (_, n) in MOE_MESHES.items():
        workdir = str(tmp_path_factory.mktemp("moe"))
        result = train.train_and_evaluate(
            moe_config(data_dir, name), workdir, devices=jax.devices()[:n]
        )
        runs[name] = (workdir, result)
    return runs


def test_moe_trains_to_the_same_losses_with_the_experts_sharded(moe_runs):
    rows = {name: metrics.read_metrics(w, "train") for name, (w, _) in moe_runs.items()}
    reference = rows["1 device"]
    assert [r["step"] for r in reference] == list(range(1, 7))
    assert reference[-1]["loss"] < reference[0]["loss"]  # it learns
    for r in reference:  # the objective: cross-entropy + 0.01 load balance + 0.001 router z
        aux = 0.01 * r["aux_load_balance"] + 0.001 * r["aux_router_z"]
        assert r["aux_loss"] == pytest.approx(aux, rel=1e-5)
        assert r["loss"] == pytest.approx(math.log(r["perplexity"]) + aux, rel=1e-5)
        assert 1.0 <= r["aux_load_balance"] <= 8.0  # between balanced (2) and collapsed (8)
    for key in ("loss", "aux_load_balance", "aux_router_z"):
        np.testing.assert_allclose(
            [r[key] for r in rows["2x2x2"]], [r[key] for r in reference], rtol=1e-5, err_msg=key
        )
    # [E, F, D] = [8, 32, 32]: 4 experts per fsdp shard, F over tensor
    wo = moe_runs["2x2x2"][1]["state"].params["decoder"]["layers_0"]["mlp"]["experts"]["wo"]
    assert wo.sharding.spec == P("fsdp", "tensor", None)
    assert {s.data.shape for s in wo.addressable_shards} == {(4, 16, 32)}


def test_moe_run_killed_after_a_checkpoint_resumes_bit_exact(
    data_dir, moe_runs, runner_env, tmp_path
):
    """experiments/run.py on the 8-device mesh, SIGKILLed right after its step-4 checkpoint,
    then resumed: every step's logged loss and auxiliary losses are the straight run's, bit for
    bit (the router's choices and the experts' shards come back as they were)."""
    from test_reliability import KILL_AFTER_SAVE

    workdir = str(tmp_path / "run")
    overrides = {**MOE_FIELDS, "checkpoint.every": 2, "mesh.data": 2, "mesh.fsdp": 2}
    overrides["mesh.tensor"] = 2
    cmd = run_command(
        workdir, data_dir, overrides, config=os.path.join(ROOT, "configs/lm.py:moe-tiny")
    )
    proc = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_SAVE, *cmd[1:]],
        env=dict(runner_env, KILL_AFTER_SAVE="4"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, (proc.stdout + proc.stderr)[-3000:]
    assert max(listed_steps(workdir)) == 4
    # The same run again, in this process (its programs are in the compilation cache).
    config = moe_config(data_dir, "2x2x2", **{"checkpoint.every": 2})
    assert train.train_and_evaluate(config, workdir)["step"] == 6

    keys = ("step", "loss", "aux_load_balance", "aux_router_z")
    straight = metrics.read_metrics(moe_runs["2x2x2"][0], "train")
    resumed = metrics.read_metrics(workdir, "train")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in straight]


def test_model_flops_count_the_experts_a_token_uses():
    """MFU's model FLOPs: of the expert kernels, top_k / num_experts (3 * 2 FLOPs per parameter
    and token), so a model that uses 2 of 8 experts counts 6/8 of them fewer than all 8."""
    from tfjax.models import decoder
    from tfjax.runner import chips

    example = {"tokens": (1, 16)}
    flops = {}
    for k in (2, 8):
        model = decoder.Model("moe-tiny", vocab_size=64, experts_per_token=k)
        params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 16), jnp.int32))
        params = nn.unbox(params["params"])
        flops[k] = chips.training_flops_per_example(model, params, example)
    layers = [v for k, v in params["decoder"].items() if k.startswith("layers_")]
    experts = sum(x.size for x in jax.tree.leaves([layer["mlp"]["experts"] for layer in layers]))
    assert experts == 2 * 8 * 3 * 32 * 32  # 2 layers of 8 experts, wi_0, wi_1 and wo of 32 x 32
    assert flops[8] - flops[2] == pytest.approx(6 * 16 * experts * 6 / 8)


def test_model_flops_of_token_mixing_by_layer_kind():
    """Beyond the weights (6 FLOPs per parameter and token, training), full attention costs
    3 * 2 * T^2 * N * (Hqk + Hv) a layer: latent attention's queries and keys are Hn + Hr wide;
    a layer attending within chunks (or a window) of C scores T * min(T, C) pairs, not T^2;
    Gated DeltaNet layers 3 * 6 * T * Nv * Hk * Hv, linear in T."""
    from tfjax.models import decoder
    from tfjax.runner import chips

    def mixing(name, t):
        model = decoder.Model(name, vocab_size=64)
        params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 8), jnp.int32))
        params = nn.unbox(params["params"])
        total = chips.training_flops_per_example(model, params, {"tokens": (1, t)})
        return total - chips.training_flops_per_example(model, params, {"tokens": (1, 1)}) * t

    t = 16
    # deepseek-tiny: 3 layers, 4 heads, Hn 8, Hr 4, Hv 6; the T = 1 call's mixing is 1 / T^2 of it
    latent = 3 * 2 * 3 * 4 * (8 + 4 + 6)
    assert mixing("deepseek-tiny", t) == pytest.approx(latent * (t * t - t))
    # qwen3.5-tiny: 3 Gated DeltaNet layers (4 value heads, Hk = Hv = 8; linear in T: nothing
    # left after subtracting T single tokens) and 1 full attention layer (4 heads of 16)
    assert mixing("qwen3.5-tiny", t) == pytest.approx(3 * 2 * 1 * 4 * (16 + 16) * (t * t - t))
    model = decoder.Model("qwen3.5-tiny", vocab_size=64)
    linear = 6 * 3 * t * 4 * 8 * 8  # forward
    assert chips._decoder_mixing_flops(model, t) == 2 * t * t * 4 * (16 + 16) + linear
    # llama4-tiny: 4 layers of 4 heads of 8, "local" ones (0 and 2) in chunks of 8, "global"
    # ones (1 and 3) over every position
    model = decoder.Model("llama4-tiny")
    pairs = 2 * t * t + 2 * t * 8
    assert chips._decoder_mixing_flops(model, t) == 2 * pairs * 4 * (8 + 8)
    # a sliding window everywhere (Mistral's) bounds every layer alike
    model = decoder.Model("tiny", vocab_size=64, sliding_window=4)
    assert chips._decoder_mixing_flops(model, t) == 2 * model.num_layers * t * 4 * 4 * (8 + 8)
