"""Rows -> training examples for the loader: `encode_example` (a row encoded and cut to
seq_len), and `RowEncoder`, which drops, counts and logs the rows that train nothing."""

from __future__ import annotations

import itertools
import threading

import numpy as np
from absl import logging

from tfjax.data.files.rows import BadRowsError


def encode_example(row, *, tokenizer, seq_len: int, split_text: bool) -> tuple[dict, int]:
    """A row -> ({"tokens": i32 [L], "weights": f32 [L]} by `encode_row`, cut to seq_len tokens
    as the loader would cut it; its prompt: the tokens before the first weighted one, 0 where
    none is: no seq_len would train such a row). With
    `split_text` (long_examples="split") text rows stay whole (the loader cuts them in pieces
    of seq_len); prompt/completion and messages rows are always cut to their first seq_len."""
    from tfjax.data.checkpoint_tokenizer import encode_row, row_format

    try:
        example = encode_row(tokenizer, row)
    except ValueError as e:  # checked when opened, yet the tokenizer refuses it (chat template)
        where = getattr(row, "origin", "") or "a row"
        raise BadRowsError(f"{where}: {e}") from e
    tokens = np.asarray(example["tokens"], np.int32)
    weights = np.asarray(example["weights"], np.float32)
    if tokens.shape != weights.shape or tokens.ndim != 1:
        raise ValueError(
            f"encode_row gave tokens {tokens.shape} and weights {weights.shape}; both must be [L]"
        )
    weighted = weights > 0
    prompt = int(np.argmax(weighted))  # (0 where no token is weighted)
    if len(tokens) > seq_len and not (split_text and row_format(row) == "text"):
        tokens, weights = tokens[:seq_len], weights[:seq_len]
    return {"tokens": tokens, "weights": weights}, prompt


def trains(weights: np.ndarray, seq_len: int) -> bool:
    """Whether an example as `encode_example` cuts it trains a token: one weighted that is not
    the first of its row or piece (the loss predicts each token from those before it in its
    segment, so a first token is never a target)."""
    targets = weights > 0
    targets[::seq_len] = False  # (a text row that long_examples="split" cuts: each piece's first)
    return bool(targets.any())


class RowEncoder:
    """The loader's transform of the rows of one split (or one source of a mixture), as Grain's
    `map_with_index` (index = epoch * rows + row): `encode_example`, or None (Grain drops the
    element) for a row that trains nothing once cut to dataset.seq_len: a prompt of seq_len
    tokens or more leaves none of its completion (or assistant turn); an empty text without bos
    has none at all, nor has a chat whose every assistant turn has "weight" 0. Kept, it would
    fill its share of the batches with no target: a run of only such rows trains nothing
    (gradient 0, loss NaN on eval), silently.

    Which rows those are is known only once they are tokenised, and tokenising a row costs 20 to
    30 times its check at opening (measured: 150 us a prompt/completion row, 320 us a chat row,
    against 7 and 11 us), so the rows are not all tokenised up front; instead
      - `check` (when the loader is made, before any step or evaluation) tokenises the first
        chat row of each conversation shape (a template's refusal is one line then, naming the
        row), then rows until one trains: 16 spread over the split, then all in order. A split
        that trains costs about one row; one that does not costs one pass, and is refused in a
        line naming dataset.seq_len and the longest prompt.
      - every row is tested as the loader encodes it, at no extra cost, and one that trains
        nothing is dropped: a split whose rows all train gives the batches and saved positions
        it gave before. The first such row of each file is logged with why; their number, per
        file, is logged when this process has encoded each row of its share of one epoch (the
        eval split: at the end of the first evaluation), exactly (each row counted once). With
        num_workers (`share` None) each worker encodes part of an epoch: the first lines only.
    """

    def __init__(self, tokenizer, *, seq_len: int, split_text: bool, field: str, rows: int, share):
        self.tokenizer, self.seq_len, self.split_text = tokenizer, seq_len, split_text
        self.field, self.rows, self.share = field, rows, share  # share: rows of this process
        self._start()

    def _start(self):
        self._lock = threading.Lock()
        self._logged = set()  # files whose first row that trains nothing was logged
        self._epochs = {}  # epoch -> its count (_Dropped) while this process encodes it
        self._counted = self.share is None  # (no count to finish: no count line)

    def __getstate__(self):  # worker processes count on their own
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._start()

    def encode(self, row) -> tuple[dict | None, int]:
        """(the example as the loader cuts it, None if it trains nothing; its prompt)."""
        example, prompt = encode_example(
            row, tokenizer=self.tokenizer, seq_len=self.seq_len, split_text=self.split_text
        )
        return (example if trains(example["weights"], self.seq_len) else None), prompt

    def why(self, prompt: int, row) -> str:
        if prompt >= self.seq_len:
            return (
                f"its prompt is {prompt} tokens, and dataset.seq_len={self.seq_len} cuts it "
                "before its completion"
            )
        if _weighted_out(row):
            return "every assistant turn of it has weight 0"
        return "it has no token to train after its first (an empty row)"

    def check(self, rows) -> None:
        """A BadRowsError naming dataset.seq_len and the longest prompt unless a row of `rows`
        trains (see the class docstring); first, the first row of each conversation shape
        (`rows.chats`, `CHAT_SHAPES`) is encoded: one the chat template refuses is a
        BadRowsError naming its file and line."""
        for i in getattr(rows, "chats", ()):
            self.encode(rows[i])
        n = len(rows)
        longest = (-1, "", None)  # (prompt, origin, row)
        for i in itertools.chain((k * n // 16 for k in range(min(n, 16))), range(n)):
            row = rows[i]
            example, prompt = self.encode(row)
            if example is not None:
                return
            if prompt > longest[0]:
                longest = (prompt, getattr(row, "origin", "") or f"row {i}", row)
        prompt, origin, row = longest
        if prompt < self.seq_len:
            raise BadRowsError(f"{self.field}: no row trains: {origin}: {self.why(prompt, row)}")
        raise BadRowsError(
            f"{self.field}: no row trains: dataset.seq_len={self.seq_len} cuts every row before "
            f"its completion (the longest prompt, {origin}, is {prompt} tokens); raise "
            "dataset.seq_len above the prompts, or shorten them"
        )

    def __call__(self, index: int, row) -> dict | None:
        example, prompt = self.encode(row)
        path = getattr(row, "path", "") or "the files"
        if example is None and path not in self._logged and self._first(path):
            logging.warning(
                "%s: %s trains nothing: %s; it is dropped, and so is every such row of %s%s",
                self.field,
                getattr(row, "origin", "") or "a row",
                self.why(prompt, row),
                path,
                "" if self.share is None else " (counted at the end of an epoch)",
            )
        if not self._counted:
            self._count(index, path if example is None else None, prompt)
        return example

    def _first(self, path: str) -> bool:
        """Whether this is the first row of `path` that trains nothing (to log)."""
        with self._lock:  # (Grain's read threads)
            first = path not in self._logged
            self._logged.add(path)
        return first

    def _count(self, index: int, dropped: str | None, prompt: int) -> None:
        epoch, row = divmod(int(index), self.rows)
        with self._lock:
            if self._counted:
                return
            if epoch not in self._epochs:
                self._epochs[epoch] = _Dropped(self.rows)
            count = self._epochs[epoch]
            if count.seen[row]:  # (an eval split read again, a read ahead)
                return
            count.seen[row] = True
            count.encoded += 1
            if dropped is not None:
                count.files[dropped] = count.files.get(dropped, 0) + 1
                if prompt >= self.seq_len:
                    count.cut, count.longest = count.cut + 1, max(count.longest, prompt)
            if count.encoded < self.share:
                return
            self._counted, self._epochs = True, {}
        if not count.files:
            return
        dropped = sum(count.files.values())
        why = []
        if count.cut:
            why.append(
                f"{count.cut} cut by dataset.seq_len={self.seq_len} before their completion (the "
                f"longest prompt: {count.longest} tokens; raise dataset.seq_len above the prompts "
                "to train them)"
            )
        if dropped > count.cut:  # (empty, or of assistant turns of weight 0)
            why.append(f"{dropped - count.cut} with no token to train")
        logging.warning(
            "%s: %d of the %d rows this process read in epoch %d train nothing and were dropped "
            "(%s): %s",
            self.field,
            dropped,
            count.encoded,
            epoch,
            ", ".join(f"{path}: {n}" for path, n in count.files.items()),
            "; ".join(why),
        )


def _weighted_out(row) -> bool:
    """Whether a chat row's every assistant turn has "weight" 0 (`message_weight`)."""
    from tfjax.data.checkpoint_tokenizer import message_weight, row_format

    if row_format(row) != "messages":
        return False
    turns = [m for m in row["messages"] if m.get("role") == "assistant"]
    return bool(turns) and not any(message_weight(m) for m in turns)


class _Dropped:
    """One epoch's count of a RowEncoder: the rows encoded (each once) and those dropped."""

    def __init__(self, rows: int):
        self.seen = np.zeros(rows, bool)
        self.encoded, self.cut, self.longest, self.files = 0, 0, 0, {}
