"""The runner with config.model.api="nnx" (tfjax.nnx.functional): from the same initial state
(the NNX model draws its own initial values, so the Linen run's are given to it) the same
losses, evaluations and parameters step for step as api="linen", on one device and on a
(data 2, fsdp 2, tensor 2) mesh of 8 CPU devices; the same checkpoints, so a Linen run resumes
as NNX (and back) and its losses continue as the Linen-only run's; what NNX cannot run yet,
and a bad api, refused by name before any work; a LoRA and a QLoRA fine-tune of a Hugging Face
checkpoint trained and exported in NNX as in Linen."""

import json
import os

import finetune_checkpoints as fc
import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import ROOT, read_checkpoint, set_fields

from tfjax import sharding
from tfjax.nnx.functional import Functional
from tfjax.runner import checks, defaults, metrics, setup, train

pytestmark = pytest.mark.usefixtures("compilation_cache")

RTOL = 1e-6  # float32: the two APIs' programs may fuse (and so round) differently
STEPS = 3


def _config(spec="lm.py:tiny", **overrides):
    config = setup.load_config(os.path.join(ROOT, "configs", spec))
    with config.unlocked():
        return set_fields(config, overrides)


def _steps(api, mesh_fields, devices, initial=None):
    """(per-step train stats, eval stats, final params, the Experiment, initial params) of STEPS
    train steps of lm.py:tiny with model.api=`api`, from one seed's initial state, its
    parameters `initial` where given (`exp.init`'s known parameters)."""
    config = _config(**{"model.api": api, **{f"mesh.{k}": v for k, v in mesh_fields.items()}})
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:devices])
    exp = setup.set_up(config, mesh, inputs=setup.planned_inputs(config))
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(1, 64, s.shape).astype(s.dtype) for k, s in exp.train_batch.items()}
    batch["tokens_segment_ids"] = np.repeat(  # packed rows: two segments each
        np.array([[1] * 20 + [2] * 12], np.int32), batch["tokens"].shape[0], 0
    )
    batch = sharding.shard_batch(batch, mesh, exp.rules)
    if initial is not None:  # placed as the runner places known parameters (donated by init)
        initial = jax.device_put(initial, exp.param_shardings)
    state = exp.init(jax.random.key(0), initial)
    initial = jax.device_get(state.params)  # before the steps donate them
    train_stats = []
    for _ in range(STEPS):
        state, stats = exp.train_step(state, batch, jax.random.key(1))
        train_stats.append(jax.device_get(stats))
    evals = jax.device_get(exp.eval_step(state.params, batch))
    return train_stats, evals, jax.device_get(state.params), exp, initial


MESHES = {
    "1 device": (dict(data=1, fsdp=1, tensor=1), 1),
    "2x2x2": (dict(data=2, fsdp=2, tensor=2), 8),
}


@pytest.mark.parametrize("mesh", MESHES)
def test_nnx_steps_give_linens_losses_and_parameters(mesh):
    fields, devices = MESHES[mesh]
    linen_stats, linen_eval, linen_params, linen_exp, initial = _steps("linen", fields, devices)
    nnx_stats, nnx_eval, nnx_params, nnx_exp, _ = _steps("nnx", fields, devices, initial)
    assert isinstance(nnx_exp.model, Functional) and not isinstance(linen_exp.model, Functional)
    # The same abstract state, laid out alike: one checkpoint layout for both.
    assert jax.tree.structure(nnx_exp.abstract_state) == jax.tree.structure(
        linen_exp.abstract_state
    )
    for a, b in zip(
        jax.tree.leaves(nnx_exp.abstract_state),
        jax.tree.leaves(linen_exp.abstract_state),
        strict=True,
    ):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and a.sharding == b.sharding
    losses = [s["loss"] for s in linen_stats]
    assert losses[-1] < losses[0]  # it learns: the steps differ from each other
    for got, want in zip(nnx_stats, linen_stats, strict=True):
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=RTOL, err_msg=k)
    for k in linen_eval:
        np.testing.assert_allclose(nnx_eval[k], linen_eval[k], rtol=RTOL, err_msg=k)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(linen_params))
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale),
        nnx_params,
        linen_params,
    )


# ------------------------------------------------------------------------- runs and resume
def _run_config(data_dir, api, **overrides):
    """lm.py:tiny for 4 steps, a checkpoint every 2, one evaluation at the end that writes
    decoded samples (sampling, decode.layout "auto") of the API's model."""
    config = _config(**{"model.api": api})
    config.data_dir = data_dir
    config.update(num_train_steps=4, log_every=1, eval_every=0, eval_steps=1)
    config.checkpoint.every = 2
    return set_fields(config, overrides)


def _losses(workdir):
    return [(r["step"], r["loss"]) for r in metrics.read_metrics(workdir, "train")]


def _samples(workdir, step):
    """(prompt, output) of each sample the evaluation at `step` decoded."""
    with open(os.path.join(workdir, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(r["prompt"], r["output"]) for r in rows if r["step"] == step]


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """Workdirs: "linen" and "nnx" straight 4-step runs; "linen->nnx" 2 steps in Linen resumed
    as NNX, "nnx->linen" the other way. Each starts from the parameters of a 2-step Linen run
    (config.init_from; the NNX model draws other initial values than Linen's)."""
    start = str(tmp_path_factory.mktemp("start"))
    first = train.train_and_evaluate(_run_config(data_dir, "linen"), start, stop_after_step=2)
    assert first["step"] == 2
    out = {}
    for name, apis in {
        "linen": ("linen",),
        "nnx": ("nnx",),
        "linen->nnx": ("linen", "nnx"),
        "nnx->linen": ("nnx", "linen"),
    }.items():
        workdir = str(tmp_path_factory.mktemp(name.replace("->", "_to_")))
        configs = [_run_config(data_dir, api, init_from=start) for api in apis]
        if len(apis) == 1:
            assert train.train_and_evaluate(configs[0], workdir)["step"] == 4
        else:
            first = train.train_and_evaluate(configs[0], workdir, stop_after_step=2)
            assert first["step"] == 2
            assert train.train_and_evaluate(configs[1], workdir)["step"] == 4
        out[name] = workdir
    return out


def _assert_same_checkpoint(got_dir, want_dir, step):
    got, want = read_checkpoint(got_dir, step), read_checkpoint(want_dir, step)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        where = jax.tree_util.keystr(path)
        assert (np.shape(a), np.asarray(a).dtype) == (np.shape(b), np.asarray(b).dtype), where
        if np.asarray(b).dtype.kind in "fc":
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7, err_msg=where)
        else:  # steps, counters, the data position and the arrays' checksums
            np.testing.assert_array_equal(a, b, err_msg=where)


@pytest.mark.parametrize("name", ["nnx", "linen->nnx", "nnx->linen"])
def test_runs_across_apis_continue_as_the_linen_run(runs, name):
    """Every step's loss, both checkpoints (the same tree: parameters, optimizer state, data
    position) and the decoded samples of a run that trained in NNX, or resumed across APIs,
    are the Linen-only run's."""
    reference, workdir = runs["linen"], runs[name]
    want = _losses(reference)
    assert [s for s, _ in want] == [1, 2, 3, 4]
    got = _losses(workdir)
    assert [s for s, _ in got] == [s for s, _ in want]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=RTOL)
    for step in (2, 4):
        _assert_same_checkpoint(workdir, reference, step)
    samples = _samples(reference, 4)
    assert len(samples) == 2 and all(output for _, output in samples)  # decoded something
    assert _samples(workdir, 4) == samples


def test_resumed_run_records_the_api_change(runs):
    with open(os.path.join(runs["linen->nnx"], "config.json")) as f:
        assert json.load(f)["model"]["api"] == "nnx"
    with open(os.path.join(runs["linen->nnx"], "config.2.json")) as f:
        assert json.load(f)["model"]["api"] == "linen"


def test_restore_model_gives_the_runs_api(data_dir, runs):
    config = _run_config(data_dir, "nnx")
    model, params, _ = train.restore_model(config, runs["nnx"], devices=jax.devices()[:1])
    assert isinstance(model, Functional)
    want = read_checkpoint(runs["nnx"], 4)["params"]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), want)


def test_nnx_run_exports_as_the_linen_run(runs, tmp_path):
    """experiments/export.py's Hugging Face checkpoint of an NNX run: the Linen run's."""
    from safetensors.numpy import load_file

    from tfjax.runner import export

    files = {}
    for name in ("linen", "nnx"):
        out = export.export_run(runs[name], str(tmp_path / name))
        with open(os.path.join(out, "config.json")) as f:
            files[name] = json.load(f), load_file(os.path.join(out, "model.safetensors"))
    (want_config, want), (got_config, got) = files["linen"], files["nnx"]
    assert got_config == want_config and got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=1e-7, err_msg=k)


# --------------------------------------------------------------------------------- refusals
def test_bad_api_is_refused_naming_the_field():
    config = _config(**{"model.api": "flax"})
    with pytest.raises(
        ValueError, match=r"model.api must be one of \('linen', 'nnx'\), got 'flax'"
    ):
        checks.check_config(config)
    assert defaults.APIS == ("linen", "nnx")


def test_a_vit_sized_by_the_datasets_images_steps_as_in_linen():
    """The ViT's NNX model is sized by the dataset's 8x8 images, as Linen's init sizes the
    model (a learned position table of 16 patches, not the 224-pixel default's): the same
    train losses."""
    losses = {}
    for api in ("linen", "nnx"):
        config = _config("vit.py:tiny", **{"model.api": api, "model.posemb": "learned"})
        mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
        exp = setup.set_up(config, mesh, inputs=setup.planned_inputs(config))
        rng = np.random.default_rng(0)
        batch = {
            k: rng.normal(size=s.shape).astype(s.dtype)
            if np.issubdtype(s.dtype, np.floating)
            else rng.integers(0, 2, s.shape).astype(s.dtype)
            for k, s in exp.train_batch.items()
        }
        batch = sharding.shard_batch(batch, mesh, exp.rules)
        state, losses[api] = exp.init(jax.random.key(0)), []
        for _ in range(2):
            state, stats = exp.train_step(state, batch, jax.random.key(1))
            losses[api].append(float(stats["loss"]))
    np.testing.assert_allclose(losses["nnx"], losses["linen"], rtol=RTOL)


def test_configs_recorded_before_the_field_run_in_linen():
    config = _config()
    with config.unlocked():
        del config.model["api"]
    assert setup.api(config) == "linen"
    model = setup.build_model(config, vocab_size=256)
    assert setup.for_api(config, model, None, None) is model  # no NNX model made


# ----------------------------------------------------------------------------- LoRA, QLoRA
# The kernels LoRA adapts by default in a Llama checkpoint, as Hugging Face names them.
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama_finetune(tmp_path_factory):
    """(a transformers-trained Llama checkpoint, train.jsonl, eval.jsonl, the eval rows):
    tests/runner/test_finetune.py's fine-tuning task."""
    root = tmp_path_factory.mktemp("finetune")
    rows = fc.task_rows("reverse", 48, 12)
    return (
        fc.build("llama", root / "llama"),
        fc.write_jsonl(root / "train.jsonl", fc.task_rows("reverse", 400, 11)),
        fc.write_jsonl(root / "eval.jsonl", rows),
        rows,
    )


def _eval_losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics.read_metrics(workdir) if r["split"] == "eval"}


def _weights(directory) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(os.path.join(directory, "model.safetensors"))


# Passes once the runner takes LoRA with model.api="nnx" (checks.check_config's refusal gone,
# setup.for_api giving Functional the LoraConfig: issue 49's H2 report); fails until then.
@pytest.mark.parametrize("base_dtype", ["", "int8"], ids=["lora", "qlora"])
def test_nnx_lora_finetune_trains_and_exports_as_linen(llama_finetune, base_dtype, tmp_path):
    """configs/finetune.py:lora,tiny (QLoRA: lora.base_dtype=int8) with model.api=nnx: the
    step-0 eval loss is the Linen run's (fresh adapters compute the base; QLoRA's base quantized
    as Linen quantizes it) and transformers' on the checkpoint; it learns the task; the merged
    export reads back in transformers with the last eval loss, changed from the checkpoint in
    the adapted kernels only; a LoRA run's adapters-only export holds each adapted layer's
    lora_A and lora_B."""
    checkpoint, train_files, eval_files, rows = llama_finetune
    losses = {}
    for api in ("linen", "nnx"):
        config = train.load_config(os.path.join(ROOT, "configs", "finetune.py:lora,tiny"))
        set_fields(
            config,
            {
                "init_from": checkpoint,
                "dataset.train_files": train_files,
                "dataset.eval_files": eval_files,
                "model.api": api,
                "lora.base_dtype": base_dtype,
                # the Linen run only gives the step-0 reference (its warmup takes 2 steps)
                "num_train_steps": 12 if api == "nnx" else 3,
                "eval_every": 12 if api == "nnx" else 3,
            },
        )
        train.train_and_evaluate(config, str(tmp_path / api))
        losses[api] = _eval_losses(str(tmp_path / api))
    got = losses["nnx"]
    np.testing.assert_allclose(got[0], losses["linen"][0], rtol=1e-5)
    assert got[0] == pytest.approx(fc.hf_loss(checkpoint, rows), rel=0.02)
    last = got[max(got)]
    assert last < 0.8 * got[0]  # it learnt the new task
    from tfjax.runner import export

    out = export.export_run(str(tmp_path / "nnx"), str(tmp_path / "hf"))
    assert fc.hf_loss(out, rows) == pytest.approx(last, rel=0.02)
    base, tuned = _weights(checkpoint), _weights(out)
    assert base.keys() == tuned.keys()
    changed = {k for k in base if not np.array_equal(base[k], tuned[k])}
    assert changed == {k for k in base if k.split(".")[-2] in ADAPTED}
    if base_dtype:
        return
    adapters = export.export_run(
        str(tmp_path / "nnx"), str(tmp_path / "adapters"), adapters_only=True
    )
    with open(os.path.join(adapters, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == checkpoint
    stored = safetensors.numpy.load_file(os.path.join(adapters, "adapter_model.safetensors"))
    assert set(stored) == {
        f"base_model.model.{k.removesuffix('.weight')}.lora_{ab}.weight"
        for k in base
        if k.split(".")[-2] in ADAPTED
        for ab in "AB"
    }
