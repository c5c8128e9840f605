"""What every family shares (tfjax.interop.core): reading checkpoint directories, load picking
the loader by architecture, export picking the one exporter that takes a model, and the
errors of weights read as another architecture's."""

import json
import os
import re

import interop_references as references
import numpy as np
import pytest
from interop_references import torch

from tfjax import interop
from tfjax.interop.core import registry
from tfjax.models import decoder, encoder, transformer, vit

gpt2 = references.gpt2
bert_mlm = references.bert_mlm
marian = references.marian


def test_directory_without_weights(tmp_path, gpt2):
    with pytest.raises(FileNotFoundError, match=f"no weights in '{tmp_path}'.*model.safetensors"):
        interop.read_state_dict(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        interop.load(tmp_path)
    _, path = gpt2
    with pytest.raises(FileNotFoundError, match="does not exist"):
        interop.from_gpt2(tmp_path / "nope", interop.read_config(path))


def _truncate(path, keep):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:keep])


def test_damaged_files_are_named(tmp_path):
    """Each damaged file a checkpoint directory holds is one ValueError naming it, what is
    wrong and what to do; eager and lazy reads alike."""
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    state = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(3)}  # 16 kB each

    # config.json: not JSON, or JSON but not an object.
    single = tmp_path / "single"
    interop.write_safetensors(state, single, config)
    for text, wrong in (("{bad", r"is not valid JSON \(Expecting"), ("[1]", "holds a JSON list")):
        (single / "config.json").write_text(text)
        with pytest.raises(ValueError, match=rf"^{single}/config\.json {wrong}.*write it again$"):
            interop.load(single)
    # A truncated model.safetensors: its header, then its data.
    weights = single / "model.safetensors"
    size = os.path.getsize(weights)
    for keep in (5, size - 100):
        _truncate(weights, keep)
        for lazy in (False, True):
            with pytest.raises(
                ValueError,
                match=rf"^{weights} cannot be read as safetensors \(SafetensorError: .*\): the "
                "file is truncated or damaged; download or write it again$",
            ):
                interop.read_state_dict(single, lazy=lazy)

    # Shards: an index without weight_map, an index that is not JSON, a truncated shard.
    sharded = tmp_path / "sharded"
    index = interop.write_safetensors(state, sharded, config, max_shard_bytes=20_000)
    with open(index) as f:
        listed = json.load(f)
    shard = sharded / sorted(set(listed["weight_map"].values()))[1]
    with open(index, "w") as f:
        json.dump({"metadata": listed["metadata"]}, f)
    with pytest.raises(
        ValueError,
        match=rf"^{index} has no weight_map of tensor name -> shard file \(found none\); the "
        "index is damaged",
    ):
        interop.read_state_dict(sharded)
    with open(index, "w") as f:
        f.write('{"weight_map": ')
    with pytest.raises(ValueError, match=rf"^{index} is not valid JSON"):
        interop.read_state_dict(sharded, lazy=True)
    with open(index, "w") as f:
        json.dump(listed, f)
    _truncate(shard, 100)
    for lazy in (False, True):
        with pytest.raises(ValueError, match=rf"^{shard} cannot be read as safetensors"):
            interop.read_state_dict(sharded, lazy=lazy)

    # pytorch_model.bin: truncated, not torch.save's, or holding more than tensors (refused:
    # unpickling runs code).
    torch_dir = tmp_path / "torch"
    os.makedirs(torch_dir)
    bin_path = torch_dir / "pytorch_model.bin"
    for content, wrong in (
        ({"w": torch.zeros(64, 64)}, r"cannot be read by torch\.load \(\w+Error: "),
        (b"garbage", r"cannot be read by torch\.load \(UnpicklingError: Unsupported operand"),
        ({"w": torch.zeros(2), "step": np.int64(3)}, r"holds objects other than tensors \("),
    ):
        if isinstance(content, bytes):
            bin_path.write_bytes(content)
        else:
            torch.save(content, bin_path)
            if "step" not in content:
                _truncate(bin_path, os.path.getsize(bin_path) // 2)
        with pytest.raises(ValueError, match=rf"^{bin_path} {wrong}"):
            interop.read_state_dict(torch_dir)


def test_unknown_architecture(tmp_path, gpt2):
    _, path = gpt2
    config = interop.read_config(path)
    config["architectures"] = ["FSMTForConditionalGeneration"]  # fairseq's WMT models
    interop.write_safetensors(dict(interop.read_state_dict(path)), tmp_path, config)
    with pytest.raises(ValueError, match=r"config\.json: architectures=.*FSMT.*has no converter"):
        interop.load(tmp_path)


def test_encoder_decoder_other_architecture_names_file_and_keys(gpt2, marian):
    _, gpt2_path = gpt2
    ref, marian_path = marian
    with pytest.raises(ValueError, match=r"missing from .*model\.safetensors.*'model\.decoder\."):
        interop.from_marian(gpt2_path, interop.read_config(marian_path))
    with pytest.raises(ValueError, match=r"no token embedding 'embed\.weight' in .*safetensors"):
        interop.from_torch_transformer(marian_path, num_heads=4)
    # A Marian state dict read as torch.nn.Transformer with the embedding named: no layers.
    with pytest.raises(ValueError, match=r"no keys under transformer\.encoder\.layers\."):
        interop.from_torch_transformer(ref.state_dict(), num_heads=4, embed="model.shared.weight")


def test_export_refuses_models_the_architecture_cannot_hold(gpt2, bert_mlm, marian):
    model, params = interop.load(gpt2[1])
    with pytest.raises(ValueError, match=r"has no activation_function for .*activation='swiglu'"):
        interop.to_gpt2(model.clone(activation="swiglu"), params)
    with pytest.raises(ValueError, match=r"one n_head for .*num_heads=4 and num_kv_heads=2"):
        interop.to_gpt2(model.clone(num_kv_heads=2), params)
    with pytest.raises(ValueError, match=r"needs a model with position='rope', norm='rms'"):
        interop.to_llama(model, params)
    model, params = interop.load(bert_mlm[1])
    with pytest.raises(ValueError, match=r"no hidden_act for .*'relu'; supported: \('gelu',\)"):
        interop.to_bert(model.clone(activation="relu"), params)
    model, params = interop.load(marian[1])
    with pytest.raises(ValueError, match=r"needs a model with .*norm_eps=1e-05.*got .*1e-06"):
        interop.to_marian(model.clone(norm_eps=1e-6), params)


# ----------------------------------------------------------------------------------------------
# The registry.


def test_load_reads_each_architecture_with_the_loader_its_family_declares():
    loaders = interop.ARCHITECTURES
    assert len(loaders) == 32  # the two DINOv2 classifiers and four multimodal wrappers among them
    for family in interop.families.ALL:
        for architecture, loader in family.CONVERTS.loads.items():
            assert loaders[architecture] is loader, architecture


def test_the_table_of_what_converts_names_each_architecture_and_converter_once():
    """interop.supported() (docs/interop.md's table): each architecture load reads is loaded by
    the one row naming it, and each converter interop exports is named by one row."""
    rows = interop.supported()
    loaded = {a: loader for row in rows for a, loader in row.loads.items()}
    assert sum(len(row.architectures) for row in rows) == len(loaded)  # each once
    assert loaded == interop.ARCHITECTURES
    named = [n for row in rows for n in re.findall(r"`((?:from|to)_\w+)`", row.converters)]
    exported = [n for n in interop.__all__ if re.fullmatch(r"(from|to)_\w+", n)]
    assert sorted(named) == sorted(exported)  # each once
    assert len(exported) == 55 and all(callable(getattr(interop, n)) for n in exported)
    gpt2_cells = ("`GPT2LMHeadModel`", "GPT-2", "`from_gpt2` / `to_gpt2`")
    assert rows[0].cells == (*gpt2_cells, "`decoder` (learned positions)")
    assert rows[18].cells[0] == "`BertForMaskedLM`, `BertForSequenceClassification`"
    assert [row.source for row in rows if not row.architectures] == [
        "`torch.nn.Transformer` with embeddings",
        "`torch.nn.MultiheadAttention`",
    ]


def test_interop_exports_every_converter_of_each_family():
    for family in interop.families.ALL:
        public = [n for n in vars(family) if re.match(r"(from|to)_", n)]
        assert public and set(public) <= set(family.__all__), family.__name__
        for name in family.__all__:
            assert name in interop.__all__ and getattr(interop, name) is getattr(family, name)


def test_two_rows_loading_one_architecture_are_refused():
    row = registry.Row("Foo", "`from_foo`", "decoder", "", loads={"FooModel": lambda d, c: None})
    with pytest.raises(ValueError, match=r"^two loaders for FooModel$"):
        registry.Registry([registry.Converts(rows=(row,)), registry.Converts(rows=(row,))])


# Every preset (the text ones with a vocabulary where the preset leaves it to the task).
PRESETS = [
    *(
        m.Model(variant=v, vocab_size=64)
        for m in (decoder, encoder, transformer)
        for v in m.VARIANTS
    ),
    *(vit.Model(v) for v in sorted(vit.VARIANTS)),
    *(vit.Model(v, num_classes=None) for v in sorted(vit.VARIANTS)),
]


def test_exporters_of_a_model_class_exclude_each_other():
    """No preset is taken by two exporters (the registry picks the one that takes a model);
    every text preset by exactly one, the one the registry picks."""
    for model in PRESETS:
        takers = [
            e for e in interop.REGISTRY.exporters if isinstance(model, e.model) and e.when(model)
        ]
        assert len(takers) <= 1, (model, [e.needs for e in takers])
        if not isinstance(model, vit.VisionTransformer):
            assert len(takers) == 1 and interop.REGISTRY.exporter(model) is takers[0], model


def test_export_of_a_model_no_family_writes_names_what_each_needs():
    with pytest.raises(ValueError, match=r"^no exporter for int$"):
        interop.export(3, {})
    model = vit.Model("tiny/4", num_classes=None)
    with pytest.raises(ValueError, match=r"^no exporter for this VisionTransformer: .*pool='map'"):
        interop.export(model, {})
    # a router bias without sinks: not a Mixtral (its bias lost), not a GPT-OSS
    model = decoder.Model(variant="moe-tiny", vocab_size=64, router_bias=True)
    with pytest.raises(
        ValueError, match=r"^no exporter for this Decoder: .*GPT-OSS: .*Mixtral, Qwen3-MoE: "
    ):
        interop.export(model, {})
