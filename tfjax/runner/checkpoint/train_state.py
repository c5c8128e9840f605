"""A TrainState as a checkpoint's items, saved and resumed by the training loop.

`params` holds state.params; `state` the rest ({"step", "opt_state", "rng" (the run's dropout key
as its raw key data), the skip counters, "ema_params" (if on)}). Checkpoints written before the
skip counters existed have none: they restore as 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from tfjax.runner.checkpoint.resume import restore_newest
from tfjax.runner.checkpoint.saving import save

# The state items that steps written before the skip counters existed lack.
OPTIONAL_STATE = ("skipped", "skipped_in_a_row")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What `restore_train_state` found: the step, the state, the dropout key and the data
    loader's position (None when the checkpoint has none for this process count)."""

    step: int
    state: Any  # tfjax.runner.steps.TrainState
    rng: jax.Array
    data_state: dict | None


@functools.cache
def _key_data_fn(sharding):
    # In a multi-process run every array the loop touches must be a global array: keys are
    # converted inside jit, replicated over the mesh.
    return jax.jit(jax.random.key_data, out_shardings=sharding)


@functools.cache
def _wrap_key_data_fn(sharding):
    return jax.jit(jax.random.wrap_key_data, out_shardings=sharding)


def _state_item(state, rng_data) -> dict:
    item = dict(
        step=state.step,
        opt_state=state.opt_state,
        rng=rng_data,
        skipped=state.skipped,
        skipped_in_a_row=state.skipped_in_a_row,
    )
    if state.ema_params is not None:
        item["ema_params"] = state.ema_params
    return item


def save_train_state(manager, step: int, state, rng, *, data_state, metrics=None) -> None:
    """`save` of a TrainState, the run's dropout key `rng` and the data position."""
    rng_data = _key_data_fn(rng.sharding)(rng)
    save(
        manager,
        step,
        params=state.params,
        state=_state_item(state, rng_data),
        data_state=data_state,
        metrics=metrics,
    )


def restore_train_state(manager, abstract_state, abstract_rng, *, restore_step=None):
    """The newest usable checkpoint of `manager` as a `Resumed` (see `restore_newest`), onto the
    shardings of `abstract_state` (a TrainState of ShapeDtypeStructs) and `abstract_rng`; None
    when the directory has no step."""
    from tfjax.runner.steps import TrainState

    key = jax.eval_shape(jax.random.key_data, abstract_rng)
    rng_data = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=abstract_rng.sharding)
    step, restored = restore_newest(
        manager,
        restore_step=restore_step,
        abstract_params=abstract_state.params,
        abstract_state=_state_item(abstract_state, rng_data),
        optional_state=OPTIONAL_STATE,
    )
    if step is None:
        return None
    s = restored["state"]
    zero = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=abstract_rng.sharding)
    state = TrainState(
        step=s["step"],
        params=restored["params"],
        opt_state=s["opt_state"],
        ema_params=s.get("ema_params"),
        **{name: s[name] if name in s else zero() for name in OPTIONAL_STATE},
    )
    rng = _wrap_key_data_fn(abstract_rng.sharding)(s["rng"])
    return Resumed(step, state, rng, restored["data"])
