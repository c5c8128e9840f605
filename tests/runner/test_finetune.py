"""Fine-tuning a Hugging Face checkpoint with configs/finetune.py, as a user runs it: small
decoders that transformers trained on one task ("copy", tests/finetune_checkpoints.py), saved
with their tokenizer.json, chat template and generation config, fine-tuned on another
("reverse") given as prompt / completion JSON lines, then exported and read back by
transformers (and a LoRA run's adapters by peft)."""

import json
import os
import shutil
import subprocess
import sys

import finetune_checkpoints as fc
import jax
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from conftest import ROOT, RUN, plain_env, set_fields

from tfjax import lora
from tfjax.interop import pretrained as hf_pretrained
from tfjax.runner import (
    checkpoint,
    checks,
    executables,
    export,
    metrics,
    pretrained,
    setup,
    train,
    workdirs,
)

FINETUNE = os.path.join(ROOT, "configs", "finetune.py")

# The resume test's three runs (and other tests' evaluations and decoding of one family) compile
# the same programs: the later ones load them from the cache.
pytestmark = pytest.mark.usefixtures("compilation_cache")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> the directory of its transformers-trained checkpoint."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: fc.build(family, root / family) for family in fc.FAMILIES}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(train.jsonl, eval.jsonl, the eval rows) of the fine-tuning task."""
    root = tmp_path_factory.mktemp("task")
    eval_rows = fc.task_rows("reverse", 48, 12)
    return (
        fc.write_jsonl(root / "train.jsonl", fc.task_rows("reverse", 400, 11)),
        fc.write_jsonl(root / "eval.jsonl", eval_rows),
        eval_rows,
    )


def finetune(checkpoint, task, workdir, preset="tiny", **overrides):
    """configs/finetune.py:<preset> from `checkpoint` on the task's files; the run's result."""
    config = train.load_config(f"{FINETUNE}:{preset}")
    set_fields(
        config,
        {
            "init_from": checkpoint,
            "dataset.train_files": task[0],
            "dataset.eval_files": task[1],
            **overrides,
        },
    )
    return train.train_and_evaluate(config, str(workdir))


def eval_losses(workdir) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in metrics.read_metrics(str(workdir)) if r["split"] == "eval"
    }


def read_weights(directory) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(os.path.join(directory, "model.safetensors"))


# The kernels LoRA adapts by default, as Hugging Face names them (DeepSeek-V3's latent
# attention: q_a_proj, q_b_proj, kv_a_proj_with_mqa and kv_b_proj, its key_up and value_up;
# Qwen3.5's Gated DeltaNet: in_proj_qkv, its query, key and value, in_proj_z, in_proj_b,
# in_proj_a and out_proj, its gate, beta, dt and out kernels, not its conv1d).
ADAPTED = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    *("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
    *("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
)
EXPORT = os.path.join(ROOT, "experiments", "export.py")


def adapted_layers(checkpoint) -> list[str]:
    """The Linear layers of `checkpoint` that LoRA adapts by default: those named in ADAPTED but
    a mixture's experts (mlp.experts.j.gate_proj, ...: their grouped matmul takes no adapters)."""
    return [
        k.removesuffix(".weight")
        for k in read_weights(checkpoint)
        if k.split(".")[-2] in ADAPTED and ".experts." not in k
    ]


def hf_logits(model, tokenizer, rows) -> list[np.ndarray]:
    """transformers' logits of each row ([bos] + prompt + completion + eos) by `model`."""
    import torch

    with torch.no_grad():
        return [
            model(torch.tensor([ids])).logits[0].numpy() for ids, _ in fc.encode(tokenizer, rows)
        ]


def check_adapters(workdir, merged, base, rows, output, names_from=None):
    """export_run(adapters_only=True) of a LoRA run: peft loads it onto its base (the adapter
    config's base_model_name_or_path) and computes the merged export's logits; the file holds
    lora_A and lora_B of each adapted Linear layer and nothing else, named as in `names_from`
    (the checkpoint AutoModelForCausalLM loads from base: a wrapper's text model) or base."""
    import peft
    import torch
    import transformers

    out = export.export_run(str(workdir), str(output), adapters_only=True)
    with open(os.path.join(out, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["base_model_name_or_path"] == base
    assert (config["r"], config["lora_alpha"]) == (16, 32.0)  # the lora preset's
    names_from = names_from or base
    layers = adapted_layers(names_from)
    # the layers' last names, unless those name others too (DeepSeek-V3's experts' gate_proj
    # beside its dense layer's and shared experts'): then their full names
    names = {m.rsplit(".", 1)[-1] for m in layers}
    others = [
        k
        for k in read_weights(names_from)
        if k.split(".")[-2] in names and k.removesuffix(".weight") not in layers
    ]
    assert sorted(config["target_modules"]) == sorted(layers if others else names)
    tensors = safetensors.numpy.load_file(os.path.join(out, "adapter_model.safetensors"))
    assert set(tensors) == {
        f"base_model.model.{layer}.lora_{ab}.weight" for layer in layers for ab in "AB"
    }
    load = transformers.AutoModelForCausalLM.from_pretrained
    tuned = peft.PeftModel.from_pretrained(
        load(config["base_model_name_or_path"], dtype=torch.float32), out
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)  # the run's tokenizer files
    rows = rows[:4]
    want = hf_logits(load(merged, dtype=torch.float32).eval(), tokenizer, rows)
    untuned = hf_logits(load(base, dtype=torch.float32).eval(), tokenizer, rows)
    for got, expected, before in zip(hf_logits(tuned, tokenizer, rows), want, untuned, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        assert np.abs(expected - before).max() > 0.1  # the adapters change the model


@pytest.mark.parametrize("preset", ["tiny", "lora,tiny"])
@pytest.mark.parametrize("family", fc.FAMILIES)
def test_finetune_starts_at_the_checkpoints_loss_and_exports_what_it_trained(
    family, preset, checkpoints, task, tmp_path
):
    """The step-0 eval loss is transformers' loss of the checkpoint on the eval rows
    (completions and eos), the eval loss falls, and transformers reads the export back with the
    last eval loss; with LoRA the export (adapters merged) differs from the checkpoint in the
    adapted kernels only (a mixture's: attention, not the experts). A mixture of experts trains
    with the load-balancing loss at the checkpoint's router_aux_loss_coef."""
    workdir = tmp_path / "run"
    finetune(checkpoints[family], task, workdir, preset)
    losses = eval_losses(workdir)
    if family == "qwen3_moe":
        with open(os.path.join(checkpoints[family], "config.json")) as f:
            weight = json.load(f)["router_aux_loss_coef"]
        trained = [r for r in metrics.read_metrics(str(workdir)) if r["split"] == "train"]
        assert trained and all(
            r["aux_loss"] == pytest.approx(weight * r["aux_load_balance"]) for r in trained
        )
    reference = fc.hf_loss(checkpoints[family], task[2])
    assert losses[0] == pytest.approx(reference, rel=0.02)
    last = losses[max(losses)]
    assert last < 0.8 * losses[0]  # it learnt the new task
    out = export.export_run(str(workdir), str(tmp_path / "hf"))
    assert fc.hf_loss(out, task[2]) == pytest.approx(last, rel=0.02)
    with open(os.path.join(out, "generation_config.json")) as f:
        stops = json.load(f)["eos_token_id"]
    with open(os.path.join(checkpoints[family], "generation_config.json")) as f:
        assert stops == json.load(f)["eos_token_id"]  # generate stops where the checkpoint's did
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    if preset.startswith("lora"):
        base, tuned = read_weights(checkpoints[family]), read_weights(out)
        assert base.keys() == tuned.keys()
        changed = {k for k in base if not np.array_equal(base[k], tuned[k])}
        assert changed == {f"{layer}.weight" for layer in adapted_layers(checkpoints[family])}
        if family in ("deepseek_v3", "llama4"):  # peft loads DeepSeek-V3's attention's
            # adapters (test below), but their dense layer's and shared experts' gate_proj, ...
            # onto the routed experts
            with pytest.raises(
                ValueError, match=r"^--adapters_only: the adapted kernel .*/mlp/.* named as the"
            ):
                export.export_run(str(workdir), str(tmp_path / "adapters"), adapters_only=True)
            assert not (tmp_path / "adapters").exists()
        else:
            check_adapters(workdir, out, checkpoints[family], task[2], tmp_path / "adapters")
        assert_adapters_only_checkpoint(workdir)
        if family == "llama":
            check_adapter_refusals(workdir, checkpoints, tmp_path)
            check_alpha_kept(workdir)
            check_base_needed(workdir, checkpoints, tmp_path)
            config = train.load_config(f"{FINETUNE}:tiny")  # a run from this LoRA run
            set_fields(config, {"init_from": str(workdir), "dataset.train_files": task[0]})
            with pytest.raises(ValueError, match="is a LoRA run's workdir: its checkpoints hold"):
                checks.check_paths(config, str(tmp_path / "next"))
    else:
        with pytest.raises(ValueError, match=r"^--adapters_only: the run has no LoRA adapters"):
            export.export_run(str(workdir), str(tmp_path / "adapters"), adapters_only=True)
        assert not (tmp_path / "adapters").exists()
    # transformers' greedy generate on the export stops where the run's eval samples did
    with open(workdir / "samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    samples = [s for s in samples if s["step"] == max(losses)]
    assert samples
    assert [s["output"] for s in samples] == fc.hf_generate(out, [s["prompt"] for s in samples])
    if family == "qwen3" and preset == "tiny":  # the decode CLI on the workdir alone
        proc = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "experiments", "decode.py"),
                f"--config={FINETUNE}:tiny",
                f"--workdir={workdir}",
                *(f"--input={s['prompt']}" for s in samples),
            ],
            cwd=ROOT,
            env=plain_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        printed = [line.split("\t", 1) for line in proc.stdout.splitlines()]
        assert printed == [[s["prompt"], s["output"]] for s in samples]
        # the export CLI refuses --adapters_only on a run without LoRA: status 1, one line
        output = tmp_path / "adapters"
        proc = subprocess.run(
            [
                sys.executable,
                EXPORT,
                f"--workdir={workdir}",
                f"--output={output}",
                "--adapters_only",
            ],
            cwd=ROOT,
            env=plain_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [line for line in proc.stderr.splitlines() if line.startswith("export.py:")]
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
        assert "--adapters_only: the run has no LoRA adapters" in lines[0]
        assert not output.exists()


def test_lora_finetunes_the_text_model_of_qwen3_5s_image_text_checkpoint(
    checkpoints, task, tmp_path
):
    """init_from a Qwen3_5ForConditionalGeneration (the qwen3_5 checkpoint's text model beside a
    vision tower, skipped by name): the step-0 eval loss is transformers' text loss, the eval
    loss falls, and the export is a text-only Qwen3_5ForCausalLM that transformers reads back
    with the last eval loss, differing from the text model in the adapted kernels only."""
    import transformers

    base = fc.build_image_text(checkpoints["qwen3_5"], tmp_path / "image_text")
    workdir = tmp_path / "run"
    finetune(base, task, workdir, "lora,tiny")
    losses = eval_losses(workdir)
    assert losses[0] == pytest.approx(fc.hf_loss(base, task[2]), rel=0.02)
    last = losses[max(losses)]
    assert last < 0.8 * losses[0]
    out = export.export_run(str(workdir), str(tmp_path / "hf"))
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.architectures == ["Qwen3_5ForCausalLM"]
    assert fc.hf_loss(out, task[2]) == pytest.approx(last, rel=0.02)
    text, tuned = read_weights(checkpoints["qwen3_5"]), read_weights(out)
    assert text.keys() == tuned.keys()
    changed = {k for k in text if not np.array_equal(text[k], tuned[k])}
    assert changed == {f"{layer}.weight" for layer in adapted_layers(checkpoints["qwen3_5"])}
    # peft's layers named as AutoModelForCausalLM loads the wrapper: its text model's
    check_adapters(workdir, out, base, task[2], tmp_path / "adapters", checkpoints["qwen3_5"])


def copy_with_init_from(workdir, copy, init_from):
    """A copy of a run's workdir whose recorded config names another init_from (as a resumed
    run with another --config.init_from records it)."""
    shutil.copytree(workdir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "init_from": init_from}))
    return copy


def assert_adapters_only_checkpoint(workdir):
    """A LoRA run's checkpoints hold its adapters, not the checkpoint's frozen base."""
    manager = checkpoint.make_manager(str(workdir / "checkpoints"), read_only=True)
    try:
        stored = checkpoint.stored_param_shapes(manager, max(manager.all_steps()))
    finally:
        manager.close()
    assert stored and all(lora.is_adapter(name) for name in stored), sorted(stored)[:4]


def replaced_in_place(source, directory):
    """A copy of checkpoint `source` with other weights of the same names, dtypes and shapes
    (another seed, an instruct model pulled into the same directory): its files' names, sizes
    and safetensors headers are the original's, byte for byte."""
    shutil.copytree(source, directory)
    path = os.path.join(directory, "model.safetensors")
    with safetensors.safe_open(path, framework="numpy") as f:
        header = f.metadata()
    weights = {k: v + np.asarray(1e-3, v.dtype) for k, v in read_weights(directory).items()}
    with open(path, "rb") as f:
        size = 8 + int.from_bytes(f.read(8), "little")
        f.seek(0)
        before = f.read(size)
    safetensors.numpy.save_file(weights, path, metadata=header)
    with open(path, "rb") as f:
        assert f.read(len(before)) == before  # the same header, other bytes
    return str(directory)


def check_base_needed(workdir, checkpoints, tmp_path):
    """Exporting, decoding and resuming a LoRA run load its base again from config.init_from:
    gone, another checkpoint, or the same one replaced in place by other weights of the same
    architecture (found by the digest of the tensors' bytes taken while they are loaded) is
    one error naming both."""
    replaced = replaced_in_place(checkpoints["llama"], tmp_path / "replaced")
    cases = [
        (str(tmp_path / "gone"), "holds no Hugging Face checkpoint, and this LoRA run's"),
        (checkpoints["qwen3"], "its weights are not the base this LoRA run's adapters"),
        (replaced, "its weights are not the base .*content digest .* was replaced"),
    ]
    for i, (init_from, message) in enumerate(cases):
        copy = copy_with_init_from(workdir, tmp_path / f"no_base_{i}", init_from)
        with pytest.raises(checkpoint.CheckpointMismatchError, match=message):
            export.export_run(str(copy), str(tmp_path / f"no_base_{i}_hf"))
    config = workdirs.read_config(str(copy))  # resuming: refused before a step
    with pytest.raises(checkpoint.CheckpointMismatchError, match=message):
        train.train_and_evaluate(config, str(copy), stop_after_step=1)


def check_alpha_kept(workdir):
    """Resuming or decoding with another lora.alpha would scale the trained adapters otherwise:
    refused naming the recorded value."""
    config = workdirs.read_config(str(workdir))
    config.lora.alpha = config.lora.alpha / 2
    with pytest.raises(ValueError, match="this workdir's adapters were trained at lora.alpha="):
        checks.check_paths(config, str(workdir), restore=True)


def check_adapter_refusals(workdir, checkpoints, tmp_path):
    """--adapters_only needs the Hugging Face checkpoint the run started from: a run from
    scratch, from another run's workdir, or whose init_from is now another checkpoint (the
    config.json a resumed run records) is refused by name, nothing written."""
    cases = [
        ("", "the run trained from scratch"),
        (str(workdir), "is not a Hugging Face checkpoint directory"),
        (checkpoints["qwen3"], "differs from the one the run started from"),
    ]
    for i, (init_from, message) in enumerate(cases):
        copy = copy_with_init_from(workdir, tmp_path / f"refused_{i}", init_from)
        output = tmp_path / f"refused_{i}_adapters"
        with pytest.raises(ValueError, match=f"^--adapters_only: .*{message}"):
            export.export_run(str(copy), str(output), adapters_only=True)
        assert not output.exists()


@pytest.mark.parametrize(
    "targets, fused, names",
    [
        (lora.DEFAULT_TARGETS, 3, ["c_attn", "c_fc", "c_proj"]),  # c_attn: query, key, value
        (".*/self_attention/(query|value)_kernel", 2, ["c_attn"]),  # its key columns: zero
        (  # attn.c_proj, not mlp.c_proj: full names
            ".*/self_attention/out_kernel",
            0,
            [f"transformer.h.{i}.attn.c_proj" for i in range(2)],
        ),
    ],
)
def test_gpt2s_conv1d_and_fused_c_attn_adapters_load_in_peft(targets, fused, names, tmp_path):
    """GPT-2's layers are Conv1D ([in, out]: fan_in_fan_out) and its query, key and value one
    fused c_attn [D, 3 D]: their adapters are written into it, lora_A stacking theirs and
    lora_B placing each in its columns (rank and alpha k r, k alpha by rank_pattern and
    alpha_pattern: the same scale). peft on the checkpoint computes the LoRA model's logits."""
    import warnings

    import ml_collections
    import peft
    import torch
    import transformers
    from conftest import with_random_lora_b

    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    base = hf_pretrained.pretrained_model(tmp_path / "gpt2")
    run = ml_collections.ConfigDict({"lora": {"rank": 2, "alpha": 4.0, "dropout": 0.0}})
    model = lora.apply_lora(base, lora.LoraConfig(rank=2, alpha=4.0, targets=targets))
    tokens = np.array([[1, 5, 9, 2, 30, 7, 7, 0]], np.int32)
    params = lora.init_params(
        model, hf_pretrained.pretrained_params(tmp_path / "gpt2", base), jax.random.key(0), tokens
    )
    params = with_random_lora_b(params)
    layers, modules = export.adapter_layers(
        model, params, hf_pretrained.family_of(tmp_path / "gpt2")[0]
    )
    assert modules == names
    adapter_config = export._adapter_config(run, str(tmp_path / "gpt2"), modules, layers)
    assert adapter_config["fan_in_fan_out"]
    fused_layers = {f"transformer.h.{i}.attn.c_attn": 2 * fused for i in range(2)} if fused else {}
    assert adapter_config["rank_pattern"] == fused_layers
    (tmp_path / "adapters").mkdir()
    export._write_adapters(export._state(layers), adapter_config, str(tmp_path / "adapters"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft's fan_in_fan_out correction
        tuned = peft.PeftModel.from_pretrained(
            transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2"), tmp_path / "adapters"
        )
    with torch.no_grad():
        got = tuned.eval()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        before = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")(
            torch.tensor(tokens, dtype=torch.long)
        ).logits.numpy()
    want, _ = model.apply({"params": params}, tokens)
    np.testing.assert_allclose(got, np.asarray(want), atol=1e-5, rtol=0)
    assert np.abs(got - before).max() > 0.05  # the adapters act


@pytest.mark.parametrize(
    "targets, names, fused",
    [
        (  # every projection of the latent attention: kv_b_proj holds key_up and value_up
            ".*/self_attention/.*_kernel",
            ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"],
            True,
        ),
        (".*/self_attention/key_up_kernel", ["kv_b_proj"], False),  # its value rows: zero
    ],
)
def test_deepseeks_latent_attention_adapters_load_in_peft(targets, names, fused, tmp_path):
    """DeepSeek-V3's latent attention's adapters as peft's on q_a_proj, q_b_proj,
    kv_a_proj_with_mqa, kv_b_proj and o_proj: key_up and value_up are both written into
    kv_b_proj (each head's key rows, then its value rows), one layer of rank 2 r (rank_pattern)
    as GPT-2's c_attn; the rotated rows of q_b_proj and kv_a_proj_with_mqa in DeepSeek's
    interleaved order. peft on the checkpoint computes the LoRA model's logits."""
    import ml_collections
    import peft
    import torch
    import transformers
    from conftest import with_random_lora_b

    config = transformers.DeepseekV3Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=12,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=16,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(tmp_path / "deepseek")
    base = hf_pretrained.pretrained_model(tmp_path / "deepseek")
    run = ml_collections.ConfigDict({"lora": {"rank": 2, "alpha": 4.0, "dropout": 0.0}})
    model = lora.apply_lora(base, lora.LoraConfig(rank=2, alpha=4.0, targets=targets))
    tokens = np.array([[1, 5, 9, 2, 30, 7, 7, 0]], np.int32)
    params = lora.init_params(
        model,
        hf_pretrained.pretrained_params(tmp_path / "deepseek", base),
        jax.random.key(0),
        tokens,
    )
    params = with_random_lora_b(params)
    layers, modules = export.adapter_layers(
        model, params, hf_pretrained.family_of(tmp_path / "deepseek")[0]
    )
    assert modules == names
    adapter_config = export._adapter_config(run, str(tmp_path / "deepseek"), modules, layers)
    kv_b = {f"model.layers.{i}.self_attn.kv_b_proj": 4 for i in range(2)} if fused else {}
    assert adapter_config["rank_pattern"] == kv_b
    (tmp_path / "adapters").mkdir()
    export._write_adapters(export._state(layers), adapter_config, str(tmp_path / "adapters"))
    load = transformers.DeepseekV3ForCausalLM.from_pretrained
    tuned = peft.PeftModel.from_pretrained(load(tmp_path / "deepseek"), tmp_path / "adapters")
    with torch.no_grad():
        got = tuned.eval()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        before = load(tmp_path / "deepseek").eval()(torch.tensor(tokens, dtype=torch.long))
    want, _ = model.apply({"params": params}, tokens)
    np.testing.assert_allclose(got, np.asarray(want), atol=1e-4, rtol=0)
    assert np.abs(got - before.logits.numpy()).max() > 0.05  # the adapters act


def test_qlora_trains_adapters_on_the_quantized_checkpoint(checkpoints, task, tmp_path):
    """lora.base_dtype=int8: the run stores the adapted kernels as int8 (loaded, then quantized),
    starts near transformers' loss, learns, and exports the adapters merged into the base they
    were trained on (dequantized): every other tensor is the checkpoint's, bit for bit."""
    from tfjax.runner import workdirs

    workdir = tmp_path / "run"
    qlora = {"lora.base_dtype": "int8"}
    straight = finetune(checkpoints["llama"], task, workdir, "lora,tiny", **qlora)
    # Stopped at step 6 and resumed: the checkpoint holds the adapters, the base is loaded and
    # quantized again; the run ends where the straight one did.
    config = train.load_config(f"{FINETUNE}:lora,tiny")
    set_fields(
        config,
        {
            "init_from": checkpoints["llama"],
            "dataset.train_files": task[0],
            "dataset.eval_files": task[1],
            **qlora,
        },
    )
    train.train_and_evaluate(config, str(tmp_path / "stopped"), stop_after_step=6)
    resumed = train.train_and_evaluate(config, str(tmp_path / "stopped"))
    for a, b in zip(
        jax.tree.leaves(straight["state"].params),
        jax.tree.leaves(resumed["state"].params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    losses = eval_losses(workdir)
    assert losses[0] == pytest.approx(fc.hf_loss(checkpoints["llama"], task[2]), rel=0.02)
    last = losses[max(losses)]
    assert last < 0.8 * losses[0]
    config = workdirs.read_config(str(workdir))
    _, params, _ = train.restore_model(config, str(workdir), devices=jax.devices()[:1])
    quantized = [
        x.array.qvalue.dtype
        for x in jax.tree.leaves(params, is_leaf=lambda x: hasattr(x, "array"))
        if hasattr(x, "array")
    ]
    assert quantized and set(quantized) == {np.dtype("int8")}
    out = export.export_run(str(workdir), str(tmp_path / "hf"))
    assert fc.hf_loss(out, task[2]) == pytest.approx(last, rel=0.02)
    base, tuned = read_weights(checkpoints["llama"]), read_weights(out)
    changed = {k for k in base if not np.array_equal(base[k], tuned[k])}
    assert changed == {f"{layer}.weight" for layer in adapted_layers(checkpoints["llama"])}
    # The adapters alone are refused: no base peft loads is the quantized one they trained on.
    with pytest.raises(ValueError, match=r"^--adapters_only: lora.base_dtype='int8': this QLoRA"):
        export.export_run(str(workdir), str(tmp_path / "adapters"), adapters_only=True)
    # Resumed or decoded with the base quantized otherwise: refused before any work.
    config.lora.base_dtype = "nf4"
    with pytest.raises(ValueError, match="^lora.base_dtype / lora.tile_size: this run's adapters"):
        checks.check_paths(config, str(workdir), restore=True)


def test_frozen_parameters_stay_bit_identical(checkpoints, task, tmp_path):
    workdir = tmp_path / "run"
    finetune(
        checkpoints["llama"],
        task,
        workdir,
        **{"optim.freeze": "embed|layers_0/", "num_train_steps": 4, "eval_every": 4},
    )
    base = read_weights(checkpoints["llama"])
    tuned = read_weights(export.export_run(str(workdir), str(tmp_path / "hf")))
    assert base.keys() == tuned.keys()
    frozen = [k for k in base if "embed_tokens" in k or ".layers.0." in k]
    assert len(frozen) == 10  # the embedding and layer 0's 9 tensors
    for key in base:
        assert np.array_equal(base[key], tuned[key]) == (key in frozen), key


def test_a_stopped_finetune_resumes_bit_exact(checkpoints, task, tmp_path):
    steps = {"num_train_steps": 6, "eval_every": 6, "checkpoint.every": 3}
    straight = finetune(checkpoints["qwen3"], task, tmp_path / "straight", **steps)
    config = train.load_config(f"{FINETUNE}:tiny")
    set_fields(
        config,
        {
            "init_from": checkpoints["qwen3"],
            "dataset.train_files": task[0],
            "dataset.eval_files": task[1],
            **steps,
        },
    )
    workdir = str(tmp_path / "stopped")
    train.train_and_evaluate(config, workdir, stop_after_step=3)
    # Another checkpoint named on resume would be ignored (the run resumes from its own): refused
    config.init_from = checkpoints["llama"]
    with pytest.raises(ValueError, match="is another checkpoint than the one this workdir's"):
        checks.check_paths(config, workdir)
    # This workdir as the next run's init_from: its model is the checkpoint's, so its export
    with pytest.raises(ValueError, match="is the workdir of a run from a Hugging Face checkpoint"):
        checks.check_paths(
            set_fields(config.copy_and_resolve_references(), {"init_from": workdir}),
            str(tmp_path / "next"),
        )
    config.init_from = str(tmp_path / "gone")  # resuming needs only the workdir
    resumed = train.train_and_evaluate(config, workdir)
    for a, b in zip(
        jax.tree.leaves(straight["state"].params),
        jax.tree.leaves(resumed["state"].params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _run_cli(tmp_path, *flags):
    """experiments/run.py with configs/finetune.py:tiny; (status, stderr, workdir)."""
    workdir = tmp_path / "run"
    cmd = [RUN, f"--config={FINETUNE}:tiny", f"--workdir={workdir}", *flags]
    proc = subprocess.run(
        [sys.executable, *cmd],
        cwd=ROOT,
        env=plain_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stderr, workdir


def test_bad_input_is_one_line_before_any_training(checkpoints, task, tmp_path):
    """A bad row, a checkpoint without a tokenizer, a size that differs from the checkpoint's,
    an unknown architecture, LoRA targets that match no kernel or a mixture's experts: status 2,
    one line naming the file or field, no run left."""
    good = checkpoints["llama"]
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"\n')
    no_tokenizer = tmp_path / "no_tokenizer"
    unknown = tmp_path / "unknown"
    shutil.copytree(good, unknown)
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(good, name), no_tokenizer / name)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(
        json.dumps({**config, "architectures": ["FooForCausalLM"]})
    )
    no_template = tmp_path / "no_template"  # chat rows need the checkpoint's chat template
    shutil.copytree(good, no_template, ignore=shutil.ignore_patterns("chat_template.jinja"))
    chats = fc.write_jsonl(
        tmp_path / "chats.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": r["prompt"]},
                    {"role": "assistant", "content": r["completion"]},
                ]
            }
            for r in task[2]
        ],
    )
    cases = [
        (no_template, chats, [], f"{chats}:1: {no_template} has no chat template"),
        (good, bad_rows, [], f"{bad_rows}:2: not JSON"),
        (
            no_tokenizer,
            task[0],
            [],
            "(the checkpoint of config.init_from: dataset.tokenizer is unset) holds no tokenizer",
        ),
        (good, task[0], ["--config.model.variant=llama-3.2-1b"], "differs from the checkpoint's"),
        (unknown, task[0], [], "architectures=['FooForCausalLM'] has no converter"),
        # the model built abstractly before any work: adapters that would attach to nothing
        (
            good,
            task[0],
            ["--config.lora.rank=4", "--config.lora.targets=nothing"],
            "lora.targets='nothing' matches none of the model's kernels",
        ),
        # QLoRA's blocks must split every adapted kernel's inputs (64 here)
        (
            good,
            task[0],
            ["--config.lora.rank=4", "--config.lora.base_dtype=nf4", "--config.lora.tile_size=48"],
            "lora.tile_size=48",
        ),
        # or to a mixture's experts, whose grouped matmul takes none
        (
            checkpoints["qwen3_moe"],
            task[0],
            ["--config.lora.rank=4", "--config.lora.targets=.*"],
            "lora.targets='.*' matches decoder/layers_0/mlp/experts/wo, a mixture of experts' "
            "stacked expert kernel",
        ),
    ]
    for init_from, train_files, extra, message in cases:
        status, stderr, workdir = _run_cli(
            tmp_path,
            f"--config.init_from={init_from}",
            f"--config.dataset.train_files={train_files}",
            f"--config.dataset.eval_files={task[1]}",
            *extra,
        )
        lines = [line for line in stderr.splitlines() if line.startswith("run.py:")]
        assert status == 2 and len(lines) == 1 and message in lines[0], stderr[-2000:]
        assert not workdir.exists() or not os.listdir(workdir)


def test_saved_programs_are_not_reused_after_the_checkpoint_changed(checkpoints, task, tmp_path):
    """A save's manifest covers what the checkpoint decides, not only the run's config: the
    same command after config.json changed at the same path (rope_theta, the same tensors) or
    after the tokenizer changed is told which, and compiles instead."""
    directory = tmp_path / "qwen3"
    shutil.copytree(checkpoints["qwen3"], directory)
    config = train.load_config(f"{FINETUNE}:tiny")
    set_fields(config, {"init_from": str(directory), "dataset.train_files": task[0]})

    def experiment():
        run = setup.prepare(config, devices=jax.devices()[:1])
        return setup.build(run, setup.planned_inputs(config))

    manifest = executables.describe(experiment())
    assert executables.mismatch(manifest, experiment()) is None
    original = (directory / "config.json").read_text()
    fields = json.loads(original)
    fields["rope_theta"] = fields.get("rope_parameters", {})["rope_theta"] = 100.0
    (directory / "config.json").write_text(json.dumps(fields))
    why = executables.mismatch(manifest, experiment())
    assert why.startswith("compiled for built model.rope_base=") and "100.0" in why, why
    (directory / "config.json").write_text(original)
    with open(directory / "tokenizer.json", "a") as f:
        f.write(" ")  # another file's bytes
    key = "checkpoint tokenizer.json"
    was, now = manifest["fields"][key], executables.experiment_fields(experiment())[key]
    assert was != now
    assert executables.mismatch(manifest, experiment()) == (
        f'compiled for {key}="{was}", this run has "{now}"'
    )


def test_a_checkpoint_that_cannot_train_is_one_line_before_any_work(checkpoints, task, tmp_path):
    """A config.json whose sizes are not its weights', a vocabulary smaller than the tokenizer
    and NaN weights: each refused by name, the first two by the checks before any work (from
    the safetensors headers), the third as the weights load (not at step 1, where the loss
    would be blamed on the learning rate), leaving no workdir."""
    source = checkpoints["llama"]
    lie, vocab, nan = (tmp_path / name for name in ("lie", "vocab", "nan"))
    for directory in (lie, vocab, nan):
        shutil.copytree(source, directory)
    fields = json.loads((lie / "config.json").read_text())
    (lie / "config.json").write_text(json.dumps({**fields, "intermediate_size": 256}))
    (vocab / "config.json").write_text(json.dumps({**fields, "vocab_size": 200}))
    weights = read_weights(source)
    rows = fields["vocab_size"]
    safetensors.numpy.save_file(
        {k: v[:200] if v.shape[0] == rows else v for k, v in weights.items()},
        str(vocab / "model.safetensors"),
    )
    down = "model.layers.0.mlp.down_proj.weight"
    weights[down] = weights[down].copy()
    weights[down][0, 0] = np.nan
    safetensors.numpy.save_file(weights, str(nan / "model.safetensors"))

    def config_from(directory):
        config = train.load_config(f"{FINETUNE}:tiny")
        return set_fields(
            config,
            {
                "init_from": str(directory),
                "dataset.train_files": task[0],
                "dataset.eval_files": task[1],
            },
        )

    workdir = str(tmp_path / "run")
    with pytest.raises(ValueError, match=r"has shape \(128, 64\), but the model built from"):
        setup.check_run(config_from(lie), workdir)
    with pytest.raises(ValueError, match=f"the tokenizer has {rows} ids, more than the 200"):
        setup.check_run(config_from(vocab), workdir)
    with pytest.raises(
        checkpoint.DamagedWeightsError,
        match=r"weights hold NaN or Inf values \(in the model's decoder/layers_0/mlp/wo/kernel\)",
    ):
        train.train_and_evaluate(config_from(nan), workdir)
    assert not os.path.exists(workdir)


def test_a_failed_start_leaves_nothing_a_rerun_reads(checkpoints, tmp_path):
    """The copy of the checkpoint's files a start keeps in the workdir is read only once the
    run has a checkpoint: a copy a failed (or killed) start left is replaced by the next start,
    so a fix to the checkpoint (a chat template added) reaches the rerun."""
    workdir = tmp_path / "run"
    shutil.copytree(checkpoints["llama"], workdir / pretrained.KEPT)  # a failed start's copy
    config = train.load_config(f"{FINETUNE}:tiny")
    set_fields(config, {"init_from": checkpoints["llama"]})
    found = pretrained.find(config, str(workdir))
    assert found.config_dir == os.path.abspath(checkpoints["llama"])
    (workdir / "checkpoints" / "6").mkdir(parents=True)  # a started run resumes from its copy
    assert pretrained.find(config, str(workdir)).config_dir == str(workdir / pretrained.KEPT)


def test_settings_that_would_be_ignored_are_refused(checkpoints, task):
    """A --workdir that is a checkpoint (or any folder of other files) would be overwritten or
    read back as data; lora.* fields without adapters, and QLoRA's block size without a
    quantized base, would do nothing: each is one line before any work."""
    config = train.load_config(f"{FINETUNE}:tiny")
    set_fields(config, {"init_from": checkpoints["llama"], "dataset.train_files": task[0]})
    with pytest.raises(ValueError, match="holds other files .* and is a Hugging Face checkpoint"):
        checks.check_paths(config, checkpoints["llama"])
    with pytest.raises(ValueError, match="holds other files .* and is not a run's workdir"):
        checks.check_paths(config, os.path.dirname(task[0]))
    # the eval samples' prompts and new tokens must fit the model's positions (128 here)
    fields = {"decode.prompt_length": 60, "decode.max_new_tokens": 100}
    over = set_fields(config.copy_and_resolve_references(), fields)
    with pytest.raises(ValueError, match=r"prompt_length=60 \+ decode.max_new_tokens=100 = 160"):
        setup.check_model(setup.resolve(over))
    for fields, message in [
        ({"lora.base_dtype": "nf4"}, "lora.base_dtype='nf4' acts only on LoRA adapters"),
        ({"lora.alpha": 8.0}, "lora.alpha=8.0 acts only on LoRA adapters"),
        ({"lora.rank": 4, "lora.tile_size": 32}, "lora.tile_size=32 is QLoRA's block size"),
    ]:
        with pytest.raises(ValueError, match=message):
            checks.check_config(set_fields(config.copy_and_resolve_references(), fields))
