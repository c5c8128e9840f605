"""Offline datasets built from files already on the machine, as ordinary TFDS builders.

They are prepared once into the data directory (ArrayRecord, no TensorFlow needed) and read back
through `tfds` data sources exactly like the catalog datasets, so the first run of a newcomer
trains on real data without any download.

  digits             the 1,797 8x8 handwritten digits shipped by scikit-learn (UCI optdigits
                     test set). Every 6th image (index % 6 == 5) is the test split: 1,498 train /
                     299 test. Images are stored as PNG, 0..16 ink scaled to 0..255.
  pydoc              CPython's own reference text (`pydoc_data/topics.py`): one example per
                     distinct paragraph; every 10th (topics in sorted order) is held out as the
                     test split. The text follows the running Python version (~1,950 / 215).
  numbers_translate  numbers written in digits -> American English words ("4021" -> "four
                     thousand twenty-one"), 0 <= n < 1,000,000. The test split holds 1,000
                     numbers picked by a fixed hash; the train split holds 60,000 others plus
                     every other number below 10,000, those below 100 a hundred times and
                     those below 1,000 ten times each, so that short forms are seen often
                     (87,984 examples).
"""

from __future__ import annotations

import abc
import gzip
import importlib.util
import io
import os

import numpy as np
import PIL.Image
import tensorflow_datasets as tfds
from etils import epath

from tfjax.data.preprocess import splitmix64

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_to_words(n: int) -> str:
    """0 <= n < 1,000,000 -> American English words, e.g. 432105 ->
    'four hundred thirty-two thousand one hundred five'."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"number_to_words covers 0..999999, got {n}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    if n < 1000:
        rest = "" if n % 100 == 0 else " " + number_to_words(n % 100)
        return f"{_ONES[n // 100]} hundred{rest}"
    rest = "" if n % 1000 == 0 else " " + number_to_words(n % 1000)
    return f"{number_to_words(n // 1000)} thousand{rest}"


def _hash_order(n: int) -> np.ndarray:
    """A fixed pseudo-random permutation of range(n) (splitmix64 finaliser): no RNG whose stream
    could change between numpy versions."""
    x = splitmix64(np.arange(n, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    return np.argsort(x, kind="stable")


def numbers_split(split: str) -> np.ndarray:
    """The numbers of a numbers_translate split, in a fixed order."""
    order = _hash_order(1_000_000)
    test = order[:1000]
    if split == "test":
        return test
    held_out = np.zeros(1_000_000, bool)
    held_out[test] = True
    small = np.arange(10_000)[~held_out[:10_000]]
    big = order[1000:][order[1000:] >= 10_000][:60_000]
    # Short numbers are rare among the rest (1-2 digits: 0.14%); repeated, a short run sees each
    # of them many times.
    copies = np.where(small < 100, 100, np.where(small < 1000, 10, 1))
    repeats = np.concatenate([np.repeat(small, copies), big])
    return repeats[_hash_order(len(repeats))]


def _digits_csv() -> str:
    # Find the file without importing sklearn (and its scipy stack).
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the 'digits' dataset is read from scikit-learn's copy of the UCI digits; "
            "install it with `pip install scikit-learn` (or `pip install -e .[data]`)."
        )
    return os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")


class _Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of the offline builders: kept out of the global TFDS registry (names like "digits"
    must not clash with other code), read by instantiating the class."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    HOMEPAGE = None  # where the data comes from
    SUPERVISED_KEYS = None  # (input, target) feature names, for as_supervised

    # tfds 4.9.10 finds a packaged builder's source through `importlib_resources`, a backport it
    # declares only for Python < 3.9; the file path is all it needs.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    @abc.abstractmethod
    def _features(self) -> tfds.features.FeatureConnector:
        """What each record holds."""

    def _info(self):
        return self.dataset_info_from_configs(
            description=self.__doc__,
            features=self._features(),
            supervised_keys=self.SUPERVISED_KEYS,
            homepage=self.HOMEPAGE,
        )


class Digits(_Builder, skip_registration=True):
    """8x8 handwritten digits (scikit-learn's copy of UCI optdigits), fixed train/test split."""

    name = "digits"
    HOMEPAGE = "https://archive.ics.uci.edu/dataset/80"
    SUPERVISED_KEYS = ("image", "label")

    def _features(self):
        return tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(shape=(8, 8, 1)),
                "label": tfds.features.ClassLabel(num_classes=10),
            }
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        with gzip.open(_digits_csv(), "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64)  # [1797, 64 pixels + label]
        is_test = np.arange(len(table)) % 6 == 5
        return {
            "train": self._generate_examples(table[~is_test]),
            "test": self._generate_examples(table[is_test]),
        }

    def _generate_examples(self, rows):
        for i, row in enumerate(rows):
            image = (row[:64].reshape(8, 8) * 255 + 8) // 16  # ink 0..16 -> 0..255, rounded
            png = io.BytesIO()
            # PNG bytes go in as they are: tfds only needs TensorFlow to encode arrays.
            PIL.Image.fromarray(image.astype(np.uint8), mode="L").save(png, format="PNG")
            yield i, {"image": png.getvalue(), "label": int(row[64])}


class Pydoc(_Builder, skip_registration=True):
    """CPython's reference topics (pydoc_data.topics), one example per paragraph."""

    name = "pydoc"
    HOMEPAGE = "https://docs.python.org/3/reference/"

    def _features(self):
        return tfds.features.FeaturesDict(
            {"text": tfds.features.Text(), "topic": tfds.features.Text()}
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        from pydoc_data.topics import topics

        paragraphs, seen = [], set()  # (topic, index in topic, text), in a fixed order
        for name in sorted(topics):
            for j, text in enumerate(p.strip("\n") for p in topics[name].split("\n\n")):
                if text.strip() and text not in seen:  # topics repeat text: keep it once
                    seen.add(text)
                    paragraphs.append((name, j, text))
        return {
            "train": self._generate_examples(p for i, p in enumerate(paragraphs) if i % 10 != 9),
            "test": self._generate_examples(p for i, p in enumerate(paragraphs) if i % 10 == 9),
        }

    def _generate_examples(self, paragraphs):
        for name, j, text in paragraphs:
            yield f"{name}/{j}", {"text": text, "topic": name}


class NumbersTranslate(_Builder, skip_registration=True):
    """Numbers in digits -> English words; held-out numbers in the test split."""

    name = "numbers_translate"
    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {
        "1.0.0": "Initial release.",
        "1.1.0": "Train numbers below 100 100x, below 1,000 10x (short forms were rare).",
    }

    SUPERVISED_KEYS = ("digits", "en")

    def _features(self):
        return tfds.features.Translation(languages=("digits", "en"))

    def _split_generators(self, dl_manager):
        del dl_manager
        return {s: self._generate_examples(numbers_split(s)) for s in ("train", "test")}

    def _generate_examples(self, numbers):
        for i, n in enumerate(numbers.tolist()):  # numbers below 1,000 repeat: key by position
            yield i, {"digits": str(n), "en": number_to_words(n)}
