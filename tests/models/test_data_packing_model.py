"""A packed batch, read with its segment ids and positions, gives each example the same decoder
outputs as that example run on its own."""

import pathlib

import jax
import numpy as np
import pytest

import tfjax.data as td
from tfjax.models import decoder


@pytest.fixture(scope="session")
def data_dir(data_dir):  # the session's (conftest.py), with pydoc prepared
    path = pathlib.Path(data_dir)
    td.prepare("pydoc", path)
    return path


def test_packed_rows_give_per_example_outputs(data_dir):
    config = {"name": "pydoc", "seq_len": 256}
    with td.make_loader(
        config,
        split="test",
        batch_size=8,
        seed=0,
        shuffle=True,
        num_epochs=None,
        data_dir=data_dir,
    ) as loader:
        # The first batch in which several rows hold more than one example. Which one that is
        # depends on the Python: pydoc is its own reference text, which changes between versions.
        for _ in range(10):
            batch = next(loader)
            segment_ids = batch["tokens_segment_ids"]
            if (segment_ids.max(axis=1) >= 2).sum() >= 3:
                break
        else:
            pytest.fail("no batch among the first 10 has 3 rows holding several examples")
        vocab_size = loader.tokenizer.vocab_size

    model = decoder.Model(variant="tiny", vocab_size=vocab_size)
    # Random weights of the right shapes: any weights must give equal outputs, and this skips
    # compiling the initialisers (seconds on a CPU).
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(model.init, jax.random.key(0), batch["tokens"][:1])
    variables = jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), shapes)
    apply = jax.jit(model.apply, static_argnames="train")
    packed, _ = apply(
        variables,
        batch["tokens"],
        segment_ids=segment_ids,
        positions=batch["tokens_positions"],
        train=False,
    )
    packed = np.asarray(packed)  # [B, T, V]
    # Each example alone, left-aligned in its own row: causal attention never sees the padding
    # after it, so its outputs are those of the example by itself.
    examples = [
        (row, np.nonzero(segment_ids[row] == segment)[0])
        for row in range(len(segment_ids))
        for segment in range(1, segment_ids[row].max() + 1)
    ]
    alone = np.zeros((len(examples), segment_ids.shape[1]), np.int32)  # [S, T]
    for i, (row, where) in enumerate(examples):
        alone[i, : len(where)] = batch["tokens"][row, where]
    unpacked = np.asarray(apply(variables, alone, train=False)[0])  # [S, T, V]
    for i, (row, where) in enumerate(examples):
        np.testing.assert_allclose(
            packed[row, where], unpacked[i, : len(where)], atol=1e-5, rtol=1e-5
        )
    assert len(examples) >= 12
