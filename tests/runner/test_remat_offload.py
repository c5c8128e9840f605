"""Remat policies, the host-offloading ones included (tfjax.nn.blocks.REMAT_POLICIES).

Every policy computes the same loss and gradients as "none" on the CPU, scanned and unrolled,
with dropout; the offload policies move what they save to host memory in the program JAX
traces, the CPU backend lowers that move as nothing, and a TPU (and a GPU) compile places
the saved activations in host memory (newer libtpu adds a buffer of its own).
"""

import re

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import nn as tnn
from tfjax import sharding
from tfjax.nn.blocks import REMAT_POLICIES
from tfjax.runner import aot, setup

OFFLOAD = ("offload_dots_no_batch", "offload_layer_inputs")
B, T, D, F, L = 2, 8, 16, 48, 2


def stack(policy: str, scan: bool) -> tnn.Stack:
    block = tnn.BlockConfig(tnn.AttentionConfig(4), tnn.MlpConfig(F), causal=True, dropout_rate=0.1)
    return tnn.Stack(block, L, scan_layers=scan, remat_policy=policy)


def loss_fn(policy: str, scan: bool):
    """A loss of the stack's output and its parameters, with dropout (train=True)."""
    model = stack(policy, scan)
    probe = jax.random.normal(jax.random.key(3), (B, T, D))

    def loss(params, x):
        y = model.apply({"params": params}, x, train=True, rngs={"dropout": jax.random.key(4)})
        return jnp.sum(y * probe)

    return loss


def value_and_grads(policy, scan, params, x):
    return jax.jit(jax.value_and_grad(loss_fn(policy, scan), argnums=(0, 1)))(params, x)


@pytest.fixture(scope="module")
def inputs():
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    params = {
        scan: nn.unbox(stack("none", scan).init(jax.random.key(1), x))["params"]
        for scan in (False, True)
    }
    return params, x


@pytest.fixture(scope="module")
def reference(inputs):
    """The loss and gradients without remat, scanned and unrolled."""
    params, x = inputs
    return {scan: value_and_grads("none", scan, params[scan], x) for scan in (False, True)}


def host_transfers(jaxpr) -> list[tuple]:
    """Shapes of the values a (closed) jaxpr moves to host memory, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put" and any(
            getattr(d, "name", "") == "Host" for d in eqn.params["devices"]
        ):
            out += [v.aval.shape for v in eqn.invars]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += host_transfers(sub)
    return out


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_every_policy_gives_the_loss_and_gradients_of_none(policy, scan, inputs, reference):
    params, x = inputs
    want = reference[scan]
    got = value_and_grads(policy, scan, params[scan], x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("policy", list(REMAT_POLICIES))
def test_what_each_policy_moves_to_host_memory(policy, scan, inputs):
    params, x = inputs
    moved = host_transfers(jax.make_jaxpr(jax.grad(loss_fn(policy, scan)))(params[scan], x))
    copies = 1 if scan else L  # a scanned stack traces its layer once
    if policy == "offload_layer_inputs":
        assert moved == [(B, T, D)] * copies  # the block's input, nothing else
    elif policy == "offload_dots_no_batch":
        # The projections' outputs: the FFN's hidden [B, T, F] among them; attention's scores
        # (a matmul with batch dimensions) are not.
        assert moved.count((B, T, F)) == copies, moved
        assert all(s[:2] == (B, T) for s in moved), moved
    else:
        assert moved == []


def test_on_the_cpu_an_offload_policy_lowers_to_no_transfer(inputs):
    """JAX lowers the host placement only for TPU and GPU: on the CPU (where device memory is
    host memory) the program keeps what the policy saves, and runs."""
    params, x = inputs
    text = jax.jit(jax.grad(loss_fn("offload_dots_no_batch", True))).lower(params[True], x)
    assert jax.default_backend() == "cpu"
    assert "pinned_host" not in text.as_text()


def tiny_lm(policy: str):
    """configs/lm.py:tiny, bfloat16, scanned, with a width that fills a TPU tile (128 lanes)."""
    config = setup.load_config("configs/lm.py:tiny")
    with config.unlocked():
        config.mesh.update(data=1, fsdp=2, tensor=2)
        config.dtype = "bfloat16"
        config.model.update(scan_layers=True, remat_policy=policy, width=128, mlp_dim=256)
        config.model.num_layers = 2  # the "tiny" preset's, named for the byte counts below
    return config


def assert_layer_inputs_on_host(config, hlo: str | None, host_bytes: int):
    """offload_layer_inputs keeps the scan's stacked layer inputs, [L, B, T, D] bf16, in host
    memory. libtpu 0.0.42 puts exactly that there; 0.0.50 also spills one layer-input-sized
    buffer of its own (double-buffered), so the bytes are bounded, not equal."""
    rows = config.batch_size // 2  # the batch is split over data x fsdp
    T, D, L = config.dataset.seq_len, config.model.width, config.model.num_layers
    layer_input = rows * T * D * 2
    if hlo is not None:  # the stacked buffer itself, in host memory space S(5)
        assert re.search(rf"bf16\[{L},{rows},{T},{D}\]{{[^}}]*S\(5\)}}", hlo), "no stacked inputs"
    assert L * layer_input <= host_bytes <= (L + 2) * layer_input, (host_bytes, layer_input)


@pytest.mark.parametrize(
    ("topology", "policy"),
    [
        *(("v5e:2x2", p) for p in ("full", "dots_no_batch", *OFFLOAD)),
        ("h100:4", "offload_layer_inputs"),
    ],
)
def test_train_step_compiles_with_host_offload(topology, policy):
    config = tiny_lm(policy)
    mesh = sharding.make_mesh(config.mesh, aot.topology_devices(topology))
    exp = setup.set_up(config, mesh, inputs=setup.planned_inputs(config))
    compiled = exp.train_step.lower(exp.abstract_state, exp.train_batch, exp.abstract_rng).compile()
    host = compiled.memory_analysis().host_temp_size_in_bytes
    rows = config.batch_size // 2  # the batch is split over data x fsdp
    layer_input = rows * config.dataset.seq_len * config.model.width * 2  # [B, T, D] bf16
    if policy == "offload_layer_inputs":
        assert_layer_inputs_on_host(config, compiled.as_text(), host)
    elif policy == "offload_dots_no_batch":
        assert host > config.model.num_layers * layer_input
    else:
        assert host == 0


def test_the_compile_report_counts_offloaded_bytes_apart_from_hbm():
    """XLA's peak counts host-memory buffers with HBM's; tfjax.runner.aot reports them apart."""
    config = tiny_lm("offload_layer_inputs")
    report = aot.compile_experiment(config, aot.topology_devices("v5e:2x2"), steps=("train",))
    (train,) = report.steps
    assert train.host_bytes > 0
    assert_layer_inputs_on_host(config, None, train.host_bytes)
    assert train.peak_bytes == (
        train.argument_bytes + train.output_bytes - train.alias_bytes + train.temp_bytes
    )
    assert "offloaded to host memory" in aot.format_report(report)
