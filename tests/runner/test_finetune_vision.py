"""Fine-tuning a vision checkpoint with configs/finetune.py:vision-tiny, as a user runs it: a
small DINOv2 written by transformers (Dinov2Model with its preprocessor_config.json) gets a new
10-class head and trains on the embedded digits written out as PNG class folders; the export is
a Dinov2ForImageClassification that transformers reads back."""

import gzip
import json
import logging
import os

import jax
import numpy as np
import PIL.Image
import pytest
import torch
import transformers
from conftest import ROOT, save_pretrained, set_fields

import tfjax.data
from tfjax import interop
from tfjax.data import embedded, image_folders
from tfjax.models import vit
from tfjax.runner import export, pretrained, setup, train

FINETUNE = os.path.join(ROOT, "configs", "finetune.py")
SIZE = 16  # the checkpoint's image processor: shortest edge 16, center crop 16 (4x4 patches)
PRETRAIN_STEPS = 400  # transformers' training of the checkpoint's tower (see `checkpoint`)


def write_digits(root):
    """The embedded digits (scikit-learn's 8x8, the same train/test split) as grey PNGs in
    root/train/<digit>/ and root/test/<digit>/."""
    with gzip.open(embedded._digits_csv(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    for i, row in enumerate(table):
        split = "test" if i % 6 == 5 else "train"
        folder = root / split / str(row[64])
        folder.mkdir(parents=True, exist_ok=True)
        image = ((row[:64].reshape(8, 8) * 255 + 8) // 16).astype(np.uint8)
        PIL.Image.fromarray(image, mode="L").save(folder / f"{i}.png")
    return str(root / "train"), str(root / "test")


def processor():
    """DINOv2's image processor (transformers' PIL backend) at SIZE px."""
    return transformers.BitImageProcessorPil(
        size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}
    )


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digits(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def checkpoint(digits, tmp_path_factory):
    """A small Dinov2Model whose position embeddings were made for 32 px (the run resamples
    them to its 16 px), with its preprocessor_config.json. A random tower of this size does not
    reach 0.95 in a CPU test's few hundred steps (0.40 after 300), so transformers pre-trains it
    first: a few seconds of Dinov2ForImageClassification on the training digits at 16 px, of
    which the tower alone is saved (the run then starts from a tower and a new head)."""
    directory = tmp_path_factory.mktemp("dinov2")
    torch.manual_seed(0)
    config = transformers.Dinov2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_ratio=2,
        patch_size=4,
        image_size=32,
        num_labels=10,
    )
    model = transformers.Dinov2ForImageClassification(config)
    processor().save_pretrained(directory)
    # the images as the processor makes them (test_images_are_what_... checks the equality)
    preprocess = image_folders.Preprocessor.read(str(directory))
    source = image_folders.open_split(
        tfjax.data.resolve_config({"name": "image_folders", "train_files": digits[0]}), "train"
    )
    records = source.read(range(len(source)))
    images = [preprocess(image_folders.decode(r["path"])) for r in records]
    pixels = torch.from_numpy(np.moveaxis(np.stack(images), -1, 1).copy())
    labels = torch.tensor([r["label"] for r in records])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model: more threads only contend (2x slower on 2 cores)
    try:
        for _ in range(PRETRAIN_STEPS):
            rows = torch.randint(0, len(labels), (64,), generator=generator)
            loss = model(pixels[rows], labels=labels[rows]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    save_pretrained(model.dinov2.eval(), directory)
    return str(directory)


def vision_config(checkpoint, digits, **overrides):
    config = train.load_config(f"{FINETUNE}:vision-tiny")
    return set_fields(
        config,
        {
            "init_from": checkpoint,
            "dataset.train_files": digits[0],
            "dataset.eval_files": digits[1],
            **overrides,
        },
    )


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def run(checkpoint, digits, tmp_path_factory):
    """(config, workdir, result, the run's log lines) of the fine-tune."""
    workdir = str(tmp_path_factory.mktemp("vision") / "run")
    config = vision_config(checkpoint, digits)
    lines, absl = _Lines(), logging.getLogger("absl")
    absl.addHandler(lines)
    level = absl.level
    absl.setLevel(logging.INFO)
    try:
        result = train.train_and_evaluate(config, workdir)
    finally:
        absl.removeHandler(lines)
        absl.setLevel(level)
    return config, workdir, result, lines.lines


def eval_batch(config, workdir, rows=64):
    """The first `rows` eval images as the run's loader makes them (and their paths)."""
    data = pretrained.dataset_spec(config, workdir)
    loader = tfjax.data.make_loader(
        data, split="eval", batch_size=rows, seed=0, shuffle=False, num_epochs=1
    )
    source = image_folders.open_split(data, "eval")
    return next(loader), [source[i]["path"] for i in range(rows)]


def hf_pixels(paths):
    """[B, H, W, 3] pixels of transformers' image processor for the files at `paths`."""
    images = [PIL.Image.open(p) for p in paths]
    return np.moveaxis(processor()(images, return_tensors="np")["pixel_values"], 1, -1)


def test_images_are_what_the_checkpoints_image_processor_makes(checkpoint, digits, tmp_path):
    """The loader's images (grey PNGs made RGB, resized bicubically to 16 px, normalised) equal
    transformers' BitImageProcessorPil's; an RGBA image is composited onto white as there."""
    config = vision_config(checkpoint, digits)
    batch, paths = eval_batch(config, None, rows=16)
    assert batch["image"].shape == (16, SIZE, SIZE, 3)
    np.testing.assert_allclose(batch["image"], hf_pixels(paths), atol=1e-5)
    assert [int(x) for x in batch["label"]] == [int(p.split(os.sep)[-2]) for p in paths]
    rgba = np.random.default_rng(0).integers(0, 256, (10, 12, 4), dtype=np.uint8)
    path = str(tmp_path / "rgba.png")
    PIL.Image.fromarray(rgba, mode="RGBA").save(path)
    ours = image_folders.Preprocessor.read(checkpoint)(image_folders.decode(path))
    np.testing.assert_allclose(ours, hf_pixels([path])[0], atol=1e-5)


def test_step_0_features_equal_transformers_and_the_head_is_new(run, checkpoint):
    """At step 0 the run's model (its parameters as the run loads them) gives transformers'
    Dinov2Model features on the same images; the head is new, said in one log line, so the
    first evaluation is chance (zero logits: loss ln 10)."""
    config, workdir, _, lines = run
    data = pretrained.dataset_spec(config, workdir)
    exp = setup.build(setup.prepare(config), setup.planned_inputs(config, data))
    loaded = pretrained.load_params(exp.pretrained, exp.model, exp.abstract_state.params)
    assert loaded["head"] == {"kernel": None, "bias": None}  # the new head: not in the checkpoint
    # the run initialises it with zeros (its step-0 loss below is ln 10)
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), exp.abstract_state.params["head"])
    params = {**loaded, "head": zeros}
    batch, _ = eval_batch(config, workdir)
    logits, aux = exp.model.apply({"params": params}, batch["image"])
    reference = transformers.Dinov2Model.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        out = reference(torch.from_numpy(np.moveaxis(batch["image"], -1, 1)))
    hidden = out.last_hidden_state.numpy()
    np.testing.assert_allclose(aux["encoded"], hidden, atol=1e-5)
    cls_gap = np.concatenate([hidden[:, 0], hidden[:, 1:].mean(1)], -1)  # the new head's input
    np.testing.assert_allclose(aux["pre_logits"], cls_gap, atol=1e-5)
    assert not np.asarray(logits).any()
    step0 = [r for r in train.metrics.read_metrics(workdir) if r["split"] == "eval"][0]
    assert step0["step"] == 0 and step0["loss"] == pytest.approx(np.log(10), rel=1e-5)
    said = [line for line in lines if "new head" in line]
    assert len(said) == 1 and "10 classes" in said[0] and checkpoint in said[0]


def test_finetuned_reaches_95_percent_and_exports_a_dinov2_classifier(run, tmp_path):
    """>= 0.95 test accuracy; transformers reads the export as a Dinov2ForImageClassification
    whose logits are the run's and whose labels are the class folders."""
    config, workdir, result, _ = run
    assert result["eval"]["accuracy"] >= 0.95
    with open(os.path.join(workdir, pretrained.CLASSES)) as f:
        assert json.load(f) == [str(d) for d in range(10)]
    out = export.export_run(workdir, str(tmp_path / "hf"))
    assert os.path.isfile(os.path.join(out, "preprocessor_config.json"))
    assert not os.path.exists(os.path.join(out, "generation_config.json"))
    hf = transformers.AutoModelForImageClassification.from_pretrained(out).eval()
    assert type(hf).__name__ == "Dinov2ForImageClassification"
    assert hf.config.id2label == {d: str(d) for d in range(10)}
    model, params, _ = train.restore_model(config, workdir)
    batch, _ = eval_batch(config, workdir)
    ours, _ = model.apply({"params": params}, batch["image"])
    with torch.no_grad():
        theirs = hf(torch.from_numpy(np.moveaxis(batch["image"], -1, 1))).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_an_eval_class_that_is_no_training_class_is_refused_by_name(checkpoint, digits, tmp_path):
    """An eval folder the head has no class for stops the run before any work, naming it."""
    bad = tmp_path / "eval"
    (bad / "7").mkdir(parents=True)
    (bad / "seven").mkdir()
    image = np.zeros((8, 8), np.uint8)
    for folder in ("7", "seven"):
        PIL.Image.fromarray(image, mode="L").save(bad / folder / "0.png")
    config = vision_config(checkpoint, digits, **{"dataset.eval_files": str(bad)})
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match="class folder 'seven' is not a class of"):
        train.train_and_evaluate(config, str(workdir))
    assert not workdir.exists()


def test_a_tower_with_a_head_hugging_face_has_no_class_for_is_refused():
    """A CLIP vision tower with a linear (biased) head exports as no Hugging Face class: the
    export names what each class needs; a DINOv2 head pooled otherwise than its classifier too."""
    small = dict(width=32, num_layers=1, mlp_dim=64, num_heads=2, num_classes=10)
    clip = vit.Model("clip-B/32", **small)
    dinov2 = vit.Model("dinov2-S/14", **small, pool="cls")
    for model, needs in ((clip, "pre_norm=False"), (dinov2, "Dinov2ForImageClassification")):
        images = jax.ShapeDtypeStruct((1, 28, 28, 3), np.float32)
        params = jax.eval_shape(model.init, jax.random.key(0), images)["params"]
        with pytest.raises(ValueError, match=needs):
            interop.export(model, params)
