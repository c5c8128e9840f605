"""Images in class folders as a dataset (catalog name "image_folders"): for fine-tuning a vision
checkpoint (`tfjax.runner.pretrained`) on the user's own labelled images.

    train/cat/001.png  train/dog/7.jpg  ...      eval/cat/...  eval/dog/...
    spec = tfjax.data.resolve_config({"name": "image_folders", "train_files": "train",
                                      "eval_files": "eval", "preprocessor": "ckpt/",
                                      "image_size": 224, "num_classes": 2})

`dataset.train_files` is a directory with one subfolder per class; the class names are the
sorted subfolder names and a label is its class's index among them. `dataset.eval_files` is a
directory of the same kind: each of its folders must be a training class (another is an error
naming it: its images have no label the head could give), and it may lack some. Each class
folder holds image files (what PIL decodes: .png, .jpg, ...; hidden files are skipped); a
subfolder or a file of another extension in it is an error naming it, as is an empty class.

Every image is made what the checkpoint's Hugging Face image processor makes of it (the fields
of its preprocessor_config.json, in the directory `dataset.preprocessor`), with PIL as the
processors' PIL backend does: made RGB (grey replicated; transparency composited onto white,
as transformers' convert_to_rgb), resized with the processor's resampling filter (its
`resample`, a PIL filter: DINOv2's and CLIP's bicubic) so that the shorter side is
size["shortest_edge"] (the longer one int(edge * long / short)) or to size["height"] x
size["width"], center-cropped to crop_size when do_center_crop, then scaled by rescale_factor
and normalised with image_mean and image_std. There is no random augmentation.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import PIL.Image

from tfjax import jsonfile

PREPROCESSOR = "preprocessor_config.json"  # a checkpoint's image processor config
EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
FIELDS = {"train": "dataset.train_files", "eval": "dataset.eval_files"}


# ----------------------------------------------------------------------------------- folders
def _folders(directory: str, field: str) -> list[str]:
    """The sorted class folder names of `directory` (a FileNotFoundError / ValueError names
    `field` when it is no directory or holds no folder)."""
    if not directory:
        raise ValueError(f"{field} is empty; give a directory with one folder per class")
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"{field}={directory!r} is no directory; a classification run reads a directory "
            "with one folder of images per class"
        )
    names = sorted(
        e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith(".")
    )
    if not names:
        raise ValueError(f"{field}={directory!r} holds no class folder (one folder per class)")
    return names


def class_names(spec) -> list[str]:
    """The classes of a run: the sorted folder names of dataset.train_files."""
    return _folders(os.path.expanduser(spec.train_files), FIELDS["train"])


def _images(folder: str, field: str) -> list[str]:
    """The image files of a class folder, sorted; anything else (hidden files aside) is an
    error naming it."""
    paths = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir() or not entry.name.lower().endswith(EXTENSIONS):
            kind = "a folder" if entry.is_dir() else "no image file"
            raise ValueError(
                f"{field}: {entry.path!r} is {kind}; a class folder holds image files only "
                f"({', '.join(EXTENSIONS)})"
            )
        paths.append(entry.path)
    if not paths:
        raise ValueError(f"{field}: the class folder {folder!r} holds no image")
    return paths


class FolderSource:
    """A Grain random-access source of {"path", "label"} records, one per image (in class
    order, then file name order)."""

    def __init__(self, records: list[tuple[str, int]]):
        self._records = records

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict:
        path, label = self._records[index]
        return {"path": path, "label": label}

    def read(self, indices) -> list[dict]:
        return [self[i] for i in indices]

    def __repr__(self) -> str:
        return f"FolderSource({len(self)} images)"


def open_split(spec, split: str) -> FolderSource:
    """The images of `split` ("train": dataset.train_files, "eval": dataset.eval_files),
    labelled by the training classes; an eval folder that is no training class is a
    ValueError naming it."""
    if split not in FIELDS:
        raise ValueError(f"dataset {spec.name!r}: split {split!r} is unknown; allowed: train, eval")
    classes = class_names(spec)
    field = FIELDS[split]
    directory = os.path.expanduser(spec.train_files if split == "train" else spec.eval_files)
    labels = {name: i for i, name in enumerate(classes)}
    records = []
    for name in _folders(directory, field):
        if name not in labels:
            raise ValueError(
                f"{field}={directory!r}: the class folder {name!r} is not a class of "
                f"dataset.train_files (the head's {len(classes)} classes: {', '.join(classes)})"
            )
        records += [(p, labels[name]) for p in _images(os.path.join(directory, name), field)]
    return FolderSource(records)


# ------------------------------------------------------------------------------- preprocessing
def _number(value, kind, what: str):
    """int or float `value`, else a ValueError naming `what` (a file and its field)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{what}={value!r}: must be a number")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{what}={value!r}: must be a number") from None


def _listed(value) -> list:
    """A per-channel list, or one value for the three channels."""
    return value if isinstance(value, list) else [value] * 3


def _pair(size: dict, what: str) -> tuple[int, int]:
    if not isinstance(size, dict) or not {"height", "width"} <= set(size):
        raise ValueError(f"{what}={size!r}: needs 'height' and 'width'")
    return _number(size["height"], int, f"{what}.height"), _number(
        size["width"], int, f"{what}.width"
    )


@dataclasses.dataclass(frozen=True)
class Preprocessor:
    """What a checkpoint's image processor does to an image (see the module docstring)."""

    shortest_edge: int | None  # resize the shorter side to this (None: to `resize`)
    resize: tuple[int, int] | None  # (height, width) to resize to; neither: no resize
    resample: int  # the PIL filter (PIL.Image.Resampling)
    crop: tuple[int, int] | None  # (height, width) of the center crop, None: none
    scale: float  # rescale_factor (1 without do_rescale)
    mean: tuple[float, ...]  # per channel (0 without do_normalize)
    std: tuple[float, ...]  # per channel (1 without do_normalize)

    @classmethod
    def read(cls, directory: str) -> Preprocessor:
        """From `directory`/preprocessor_config.json; a field it lacks or a value not
        supported is a ValueError naming it."""
        path = os.path.join(directory, PREPROCESSOR)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} does not exist: the image size and normalisation of a vision "
                "checkpoint come from its preprocessor_config.json"
            )
        c = jsonfile.read_object(path, "an image processor's config (preprocessor_config.json)")

        def need(key):
            if key not in c:
                raise ValueError(f"{path}: has no {key!r}")
            return c[key]

        shortest_edge = size = None
        if c.get("do_resize"):
            given = need("size")
            if isinstance(given, dict) and set(given) == {"shortest_edge"}:
                shortest_edge = _number(given["shortest_edge"], int, f"{path}: size.shortest_edge")
            else:
                size = _pair(given, f"{path}: size")
            resample = _number(need("resample"), int, f"{path}: resample")
            if resample not in {int(r) for r in PIL.Image.Resampling}:
                raise ValueError(f"{path}: resample={resample} is not one of PIL's filters (0-5)")
        else:
            resample = int(PIL.Image.Resampling.BILINEAR)  # unused
        crop = _pair(need("crop_size"), f"{path}: crop_size") if c.get("do_center_crop") else None
        scale = 1.0
        if c.get("do_rescale"):
            scale = _number(need("rescale_factor"), float, f"{path}: rescale_factor")
        mean, std = (0.0,) * 3, (1.0,) * 3
        if c.get("do_normalize"):
            mean, std = need("image_mean"), need("image_std")
            mean = [_number(m, float, f"{path}: image_mean") for m in _listed(mean)]
            std = [_number(s, float, f"{path}: image_std") for s in _listed(std)]
            mean, std = tuple(mean), tuple(std)
            if len(mean) != 3 or len(std) != 3:
                raise ValueError(f"{path}: image_mean and image_std need 3 channels (RGB)")
        if crop is None and size is None:
            raise ValueError(
                f"{path}: without a center crop or a resize to height x width the images keep "
                "sizes of their own; a run needs one square size"
            )
        out = crop or size
        if out[0] != out[1]:
            raise ValueError(
                f"{path}: the images come out {out[0]}x{out[1]}; a run needs them square"
            )
        return cls(shortest_edge, size, resample, crop, scale, mean, std)

    @property
    def image_size(self) -> int:
        """The side of the square images it makes."""
        return (self.crop or self.resize)[0]

    def __call__(self, image: PIL.Image.Image) -> np.ndarray:
        """A decoded image -> float32 [S, S, 3]."""
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            image = image.convert("RGBA")
            white = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
            image = PIL.Image.alpha_composite(white, image)
        image = image.convert("RGB")
        w, h = image.size
        if self.shortest_edge is not None:
            short, long = min(h, w), max(h, w)
            new_long = int(self.shortest_edge * long / short)
            h, w = (self.shortest_edge, new_long) if h <= w else (new_long, self.shortest_edge)
        elif self.resize is not None:
            h, w = self.resize
        if (w, h) != image.size:
            image = image.resize((w, h), PIL.Image.Resampling(self.resample))
        pixels = np.asarray(image)
        if self.crop is not None:
            ch, cw = self.crop
            top, left = (h - ch) // 2, (w - cw) // 2
            if top < 0 or left < 0:  # smaller than the crop: zero-padded around, as HF does
                padded = np.zeros((max(h, ch), max(w, cw), 3), np.uint8)
                padded[max(-top, 0) : max(-top, 0) + h, max(-left, 0) : max(-left, 0) + w] = pixels
                pixels, top, left = padded, max(top, 0), max(left, 0)
            pixels = pixels[top : top + ch, left : left + cw]
        x = (pixels.astype(np.float64) * self.scale).astype(np.float32)
        return (x - np.float32(self.mean)) / np.float32(self.std)


def decode(path: str) -> PIL.Image.Image:
    """The image at `path`, decoded (a file PIL cannot read is a ValueError naming it)."""
    try:
        with PIL.Image.open(path) as image:
            image.load()
            return image
    except (OSError, PIL.UnidentifiedImageError) as e:
        raise ValueError(f"{path}: not a readable image ({e})") from None


def image_batch(positions, *, source, preprocessor: Preprocessor, batch_size: int) -> dict:
    """Stream positions [b <= B] -> {"image": f32 [B, S, S, 3], "label": i32 [B], "weights":
    f32 [B] (0 on the padding rows of a last partial batch)}."""
    positions = np.asarray(positions, np.int64)
    size = preprocessor.image_size
    images = np.zeros((batch_size, size, size, 3), np.float32)
    labels = np.zeros(batch_size, np.int32)
    weights = (np.arange(batch_size) < len(positions)).astype(np.float32)
    for i, record in enumerate(source.read((positions % len(source)).tolist())):
        images[i] = preprocessor(decode(record["path"]))
        labels[i] = record["label"]
    return {"image": images, "label": labels, "weights": weights}
