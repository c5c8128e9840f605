"""Per-example and per-batch transforms as pure numpy functions (randomness comes in as `rng`).

Per-example work costs Python overhead for every example, so each example only does what
depends on its own size (resizing, crops of varying size, tokenising); shifting, flipping,
normalising and padding happen once per batch, vectorised, with random choices keyed by
example (`keyed_uniform`).

Shapes: H, W image height and width, C channels, L example length (varies), T fixed sequence
length, B batch size.
"""

from __future__ import annotations

import math

import numpy as np
import PIL.Image

from tfjax.data.catalog import CROPS
from tfjax.data.tokenizers import MASK_ID, NUM_SPECIAL


# ----------------------------------------------------------------------------------------- images
def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of a uint8 image [H, W, C] -> [height, width, C]."""
    if image.shape[:2] == (height, width):
        return image
    channels = image.shape[-1]
    pil = PIL.Image.fromarray(image[..., 0] if channels == 1 else image)
    out = np.asarray(pil.resize((width, height), PIL.Image.BILINEAR))
    return out.reshape(height, width, channels)


def inception_crop(
    image: np.ndarray,
    size: int,
    rng: np.random.Generator,
    area_range: tuple[float, float] = (0.08, 1.0),
    aspect_range: tuple[float, float] = (3 / 4, 4 / 3),
) -> np.ndarray:
    """Random-area, random-aspect crop resized to [size, size, C] (Szegedy et al., 2015)."""
    h, w = image.shape[:2]
    for _ in range(10):  # rejection sampling; fall back to the whole image
        area = h * w * rng.uniform(*area_range)
        aspect = math.exp(rng.uniform(math.log(aspect_range[0]), math.log(aspect_range[1])))
        ch, cw = round(math.sqrt(area / aspect)), round(math.sqrt(area * aspect))
        if 0 < ch <= h and 0 < cw <= w:
            top, left = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
            return resize(image[top : top + ch, left : left + cw], size, size)
    return resize(image, size, size)


def resize_and_center_crop(image: np.ndarray, size: int, crop_fraction: float = 0.875):
    """Eval counterpart of `inception_crop`: shorter side to size / crop_fraction, then the
    central [size, size, C]."""
    h, w = image.shape[:2]
    scale = size / crop_fraction / min(h, w)
    rh, rw = max(size, round(h * scale)), max(size, round(w * scale))
    image = resize(image, rh, rw)
    top, left = (rh - size) // 2, (rw - size) // 2
    return image[top : top + size, left : left + size]


def fit_image(
    image: np.ndarray, *, size: int, crop: str, train: bool, rng: np.random.Generator
) -> np.ndarray:
    """Decoded uint8 image [H, W(, C)] -> uint8 [size, size, C].

    crop="inception": a random-area crop when training, resize + center crop otherwise;
    "pad" and "none": a plain resize (the random shift of "pad" happens in `augment_batch`).
    """
    if crop not in CROPS:
        raise ValueError(f"crop must be one of {CROPS}, got {crop!r}")
    if image.ndim == 2:
        image = image[..., None]
    if crop == "inception":
        return inception_crop(image, size, rng) if train else resize_and_center_crop(image, size)
    return resize(image, size, size)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijective mix of uint64 values (vectorised, wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keyed_uniform(seed: int, keys: np.ndarray, n: int) -> np.ndarray:
    """Uniform floats in [0, 1) [len(keys), n], a pure function of (seed, key, column): an
    example's random choices do not depend on the batch, process or worker it lands in."""
    counters = np.asarray(keys, np.uint64)[:, None] * np.uint64(n) + np.arange(n, dtype=np.uint64)
    x = splitmix64(counters + np.uint64((seed * 0x9E3779B97F4A7C15) % 2**64))
    return (x >> np.uint64(11)).astype(np.float64) / 2**53


def draw_augmentations(
    u: np.ndarray, *, padding: int, random_flip: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Random choices for `augment_batch` from uniforms u [B, 3]: shifts int32 [B, 2] in
    [-padding, padding] and horizontal flips bool [B]."""
    shifts = np.floor(u[:, :2] * (2 * padding + 1)).astype(np.int32) - padding
    return shifts, (u[:, 2] < 0.5) & random_flip


def augment_batch(
    images: np.ndarray, shifts: np.ndarray, flips: np.ndarray, padding: int
) -> np.ndarray:
    """Shifts each image by its own (dy, dx) filling with zeros (= zero-pad `padding` pixels and
    crop at a random offset), flips where asked, and maps uint8 [0, 255] to float32 [-1, 1].

    Args:
      images: uint8 [B, H, W, C]; shifts: int [B, 2] in [-padding, padding]; flips: bool [B].
    Returns:
      float32 [B, H, W, C].
    """
    b, h, w, _ = images.shape
    if padding and shifts.any():
        padded = np.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
        rows = padding - shifts[:, :1] + np.arange(h)  # [B, H]
        cols = padding - shifts[:, 1:] + np.arange(w)  # [B, W]
        images = padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]
    if flips.any():
        images = np.where(flips[:, None, None, None], images[:, :, ::-1], images)
    return images.astype(np.float32) * (2 / 255) - 1


# ------------------------------------------------------------------------------------------- text
def mask_tokens(
    tokens: np.ndarray, *, rng: np.random.Generator, vocab_size: int, probability: float = 0.15
) -> tuple[np.ndarray, np.ndarray]:
    """BERT's corruption: picks `probability` of the real tokens; of those 80% become mask_id,
    10% a random real token and 10% stay as they are.

    Args:
      tokens: int32 [L]; ids below NUM_SPECIAL (pad, bos, eos, ...) are never picked.
    Returns:
      corrupted int32 [L] and weights float32 [L], 1.0 where a token was picked for prediction.
    """
    picked = (rng.random(tokens.shape) < probability) & (tokens >= NUM_SPECIAL)
    action = rng.random(tokens.shape)
    random_ids = rng.integers(NUM_SPECIAL, vocab_size, tokens.shape, dtype=np.int32)
    corrupted = np.where(picked & (action < 0.8), MASK_ID, tokens)
    corrupted = np.where(picked & (action >= 0.8) & (action < 0.9), random_ids, corrupted)
    return corrupted.astype(np.int32), picked.astype(np.float32)


def split_example(example: dict[str, np.ndarray], length: int) -> list[dict[str, np.ndarray]]:
    """Cuts every array [L] of an example into consecutive pieces [<= length] (the last may be
    shorter); nothing is dropped."""
    n = max(len(v) for v in example.values())
    return [{k: v[i : i + length] for k, v in example.items()} for i in range(0, n, length)]


def truncate_example(example: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """Keeps the first `length` items of every array [L]."""
    return {k: v[:length] for k, v in example.items()}


# ---------------------------------------------------------------------------------------- batches
def collate(examples: list[dict], *, batch_size: int, length: int | None = None) -> dict:
    """Stacks example dicts into a batch of fixed shape: missing rows of a last partial batch
    are zeros, and with `length` every 1-d array [L <= length] is right-padded with zeros to
    [length] (pad id 0, weight 0).

    Returns:
      {key: [batch_size, ...]}, or [batch_size, length] for the 1-d arrays when `length` is set.
    """
    batch = {}
    for key, first in examples[0].items():
        first = np.asarray(first)
        ragged = length is not None and first.ndim == 1
        out = np.zeros((batch_size, length) if ragged else (batch_size, *first.shape), first.dtype)
        for i, example in enumerate(examples):
            value = example[key]
            if ragged:
                if len(value) > length:
                    raise ValueError(f"{key!r} has {len(value)} items, more than {length}")
                out[i, : len(value)] = value
            else:
                out[i] = value
        batch[key] = out
    return batch
