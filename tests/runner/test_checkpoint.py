"""tfjax.runner.checkpoint: restoring onto other meshes, retention, compatibility checks."""

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tfjax import sharding, tasks
from tfjax.models import decoder
from tfjax.runner import checkpoint, optim, setup
from tfjax.runner.steps import make_train_step

SPEC = {
    "tokens": jax.ShapeDtypeStruct((16, 32), jnp.int32),
    "weights": jax.ShapeDtypeStruct((16, 32), jnp.float32),
}


def optim_config():
    return ml_collections.ConfigDict(
        dict(
            name="adamw",
            learning_rate=1e-2,
            schedule="constant",
            warmup_steps=0,
            end_learning_rate_fraction=0.0,
            b1=0.9,
            b2=0.98,
            eps=1e-9,
            weight_decay=0.1,
            grad_clip_norm=1.0,
            ema_decay=0.0,
        )
    )


def _set_up(mesh, width):
    model = decoder.Model("tiny", vocab_size=128, width=width)
    tx = optim.make_optimizer(optim_config(), d_model=width, num_train_steps=10)
    task = tasks.get("lm")
    init_fn, abstract, _ = setup.abstract_train_state(
        model, tx, task, SPEC, mesh=mesh, rules=sharding.DEFAULT_RULES, ema=False
    )
    return model, tx, task, init_fn, abstract


def abstract_state(mesh, *, width=32):
    """The abstract TrainState (shapes and shardings) of make_state's decoder on `mesh`: what a
    restore needs, without compiling the initialisation."""
    return _set_up(mesh, width)[-1]


def make_state(mesh, *, steps):
    """A tiny decoder's TrainState on `mesh`, after `steps` updates on random tokens."""
    model, tx, task, init_fn, abstract = _set_up(mesh, width=32)
    rules = sharding.DEFAULT_RULES
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    state = jax.jit(init_fn, out_shardings=shardings)(jax.random.key(1))
    step_fn = jax.jit(
        make_train_step(model, task, tx, mesh=mesh, rules=rules),
        out_shardings=(shardings, sharding.replicated(mesh)),
    )
    for i in range(steps):
        tokens = jax.random.randint(jax.random.key(i), (16, 32), 1, 128)
        batch = {"tokens": np.asarray(tokens), "weights": np.ones(tokens.shape, np.float32)}
        batch = sharding.shard_batch(batch, mesh, rules)
        state, _ = step_fn(state, batch, jax.random.key(7))
    return state


def ckpt_state(state, rng):
    return dict(step=state.step, opt_state=state.opt_state, rng=rng)


def abstract_ckpt_state(abstract, mesh):
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(mesh))
    return dict(step=abstract.step, opt_state=abstract.opt_state, rng=rng)


def leaves_equal(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint written from 8 devices (data=2, fsdp=2, tensor=2) after 2 updates."""
    mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
    state = make_state(mesh, steps=2)
    rng = np.array([3, 4], np.uint32)
    directory = str(tmp_path_factory.mktemp("ckpt") / "checkpoints")
    config = ml_collections.ConfigDict(
        dict(
            every=1, keep=3, best_metric="", best_mode="max", async_save=True, replica_parallel=True
        )
    )
    manager = checkpoint.make_manager(directory, config)
    checkpoint.save(
        manager, 2, params=state.params, state=ckpt_state(state, rng), data_state={"position": 17}
    )
    manager.wait_until_finished()
    manager.close()
    return directory, state, rng


@pytest.mark.parametrize(
    "mesh_config, n, kernel_shard",
    [(dict(data=1, fsdp=1, tensor=1), 1, (32, 128)), (dict(data=1, fsdp=4, tensor=1), 4, (8, 128))],
)
def test_restores_on_another_mesh_with_identical_values(saved, mesh_config, n, kernel_shard):
    directory, state, rng = saved
    mesh = sharding.make_mesh(mesh_config, jax.devices()[:n])
    abstract = abstract_state(mesh)
    manager = checkpoint.make_manager(directory, read_only=True)
    restored = checkpoint.restore(
        manager,
        2,
        abstract_params=abstract.params,
        abstract_state=abstract_ckpt_state(abstract, mesh),
    )
    manager.close()
    assert leaves_equal(restored["params"], state.params)
    assert leaves_equal(restored["state"]["opt_state"], state.opt_state)
    assert int(restored["state"]["step"]) == 2
    np.testing.assert_array_equal(restored["state"]["rng"], rng)
    assert restored["data"] == {"position": 17}
    kernel = restored["params"]["decoder"]["layers_0"]["mlp"]["wi"]["kernel"]  # [32, 128]
    assert kernel.sharding.mesh.devices.size == n
    assert kernel.sharding.spec == P("fsdp", "tensor")
    assert {s.data.shape for s in kernel.addressable_shards} == {kernel_shard}


def test_mismatched_model_names_the_parameter_and_deletes_nothing(saved):
    directory, _, _ = saved
    before = sorted(os.walk(directory))
    mesh = sharding.make_mesh(dict(data=-1))
    abstract = abstract_state(mesh, width=64)
    manager = checkpoint.make_manager(directory, read_only=True)
    with pytest.raises(ValueError, match=r"parameter 'decoder/final_norm/bias' has shape \(32,\)"):
        checkpoint.restore(
            manager,
            2,
            abstract_params=abstract.params,
            abstract_state=abstract_ckpt_state(abstract, mesh),
        )
    manager.close()
    assert sorted(os.walk(directory)) == before


def test_check_params_fit_reports_missing_and_extra():
    stored = {"a/kernel": (2, 3), "b/kernel": (4,)}
    wanted = {
        "a": {"kernel": jax.ShapeDtypeStruct((2, 3), jnp.float32)},
        "c": {"kernel": jax.ShapeDtypeStruct((4,), jnp.float32)},
    }
    with pytest.raises(ValueError, match=r"'b/kernel' \(4,\) is not in the model \(and 1 more"):
        checkpoint.check_params_fit(stored, wanted, "x")
    checkpoint.check_params_fit({"a/kernel": (2, 3)}, {"a": {"kernel": wanted["a"]["kernel"]}}, "x")


@pytest.mark.parametrize("async_save", [True, False])
def test_keeps_the_last_k_and_the_best(tmp_path, async_save):
    params = {"w": jnp.arange(4.0)}
    config = ml_collections.ConfigDict(
        dict(
            every=1,
            keep=2,
            best_metric="accuracy",
            best_mode="max",
            async_save=async_save,
            replica_parallel=False,
        )
    )
    manager = checkpoint.make_manager(str(tmp_path), config)
    accuracy = {1: 0.5, 2: 0.9, 3: 0.6, 4: 0.7, 5: None}
    for step, acc in accuracy.items():
        checkpoint.save(
            manager,
            step,
            params=jax.tree.map(lambda x, s=step: x * s, params),
            state={"step": jnp.int32(step)},
            data_state=None,
            metrics=None if acc is None else {"accuracy": acc},
        )
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 4, 5]  # the best (2) and the newest two
    restored = checkpoint.restore(
        manager,
        5,
        abstract_params=jax.eval_shape(lambda: params),
        abstract_state={"step": jax.ShapeDtypeStruct((), jnp.int32)},
    )
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(4.0) * 5)
    assert restored["data"] is None
    manager.close()


def test_a_best_metric_the_evaluation_never_gives_is_refused_before_the_run():
    """A best_metric no evaluation of the run gives (issue 38: "bleu" on a classification run)
    would never keep a best step: refused by name before any work, with the allowed ones."""
    configs = os.path.join(os.path.dirname(__file__), "..", "..", "configs")

    def config(spec, **checkpoint_fields):
        c = setup.load_config(os.path.join(configs, spec))
        c.checkpoint.update(checkpoint_fields)
        return c

    for spec in ("vit.py", "mlm.py", "translate.py", "finetune.py", "lm.py"):  # as shipped
        checkpoint.check_best_metric(config(spec))
    with pytest.raises(
        ValueError,
        match=r"^checkpoint.best_metric='bleu' is not an eval metric of task='classification'; "
        r"allowed: loss, accuracy, or '' to keep only the newest checkpoints$",
    ):
        checkpoint.check_best_metric(config("vit.py:tiny", best_metric="bleu"))
    checkpoint.check_best_metric(config("translate.py:tiny", best_metric="bleu"))  # it decodes
    with pytest.raises(ValueError, match="allowed: loss, accuracy, perplexity, or ''"):
        checkpoint.check_best_metric(config("lm.py:tiny", best_metric="bleu"))
