"""A row of the user's files: what is wrong with it (`row_problem`), its conversation shape (the
chat rows encoded when the loader is made), where it comes from (`Row`), and the errors and
counts of bad rows (`BadRowsError`, `BadRows`)."""

from __future__ import annotations

from absl import logging


class BadRowsError(ValueError):
    """A row of the user's files that cannot be read or encoded, or a file that cannot be read
    at all: the message names the file and line (or row) and what is wrong. Raised when the
    files are opened, before any training; experiments/run.py reports it in one line."""


class BadRows:
    """Counts (or raises on) the bad rows of one file."""

    def __init__(self, path, skip: bool, unit: str):
        self.path, self.skip, self.unit = path, skip, unit
        self.count, self.first = 0, None

    def __call__(self, number: int, problem: str) -> None:
        # path:line as editors and compilers write it; Parquet and Arrow rows have no lines.
        where = f"{self.path}: row {number}" if self.unit == "row" else f"{self.path}:{number}"
        if not self.skip:
            raise BadRowsError(f"{where}: {problem} (dataset.skip_bad_rows=True skips such rows)")
        self.count += 1
        self.first = self.first or f"{where}: {problem}"

    def log(self, total: int) -> None:
        if self.count:
            logging.warning(
                "dataset.skip_bad_rows: skipped %d of %d rows of %s (the first: %s)",
                self.count,
                total,
                self.path,
                self.first,
            )


def row_problem(row) -> str | None:
    """What is wrong with a row (None: nothing): not an object, a format row_format does not
    know or whose fields are missing, fields that are not text, or a message "weight" that is
    not 0 or 1 on an assistant message (`checkpoint_tokenizer.message_weight`)."""
    from tfjax.data.checkpoint_tokenizer import message_weight, row_format

    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    try:
        kind = row_format(row)
    except ValueError as e:
        return str(e)
    fields = {"text": ("text",), "prompt_completion": ("prompt", "completion")}.get(kind, ())
    for key in fields:
        if key not in row:
            return f"{kind} row without {key!r}"
        if not isinstance(row[key], str):
            return f"{key!r} must be a string, got {type(row[key]).__name__}"
    if kind == "messages":
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list of {'role', 'content'} objects"
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                return f"message {i} must be an object with 'role' and 'content'"
            for key in ("role", "content"):
                if message.get(key) is None:
                    return f"message {i} has no {key!r}"
                if not isinstance(message[key], str):
                    return f"message {i}: {key!r} must be a string"
            try:
                message_weight(message)
            except ValueError as e:
                return f"message {i}: {e}"
        if not any(m["role"] == "assistant" for m in messages):
            return "'messages' has no 'assistant' turn: nothing to train on"
    return None


# Chat rows are checked against the template when the loader is made by encoding one row of
# each distinct conversation shape (`_chat_shape`), the first CHAT_SHAPES of them. Measured on
# 10k chat rows of 1 to 2 turns (2 shared cores): the scan at opening costs 10 us a row, and
# taking its shape 2 us more; rendering each whole conversation would cost 22 to 47 us (the
# Qwen3, Gemma 3 and Llama 3 test checkpoints' templates: 2 to 4 times the scan), and every
# rendering encode_row makes to split it into turns 92 to 109 us (8 times): too much at every
# start. A template's refusal usually depends on the shape (an order of roles it refuses, a role
# or key it does not know), rarely on the text; a row refused for its text alone is still one
# line naming it, when training reaches it.
CHAT_SHAPES = 256


def _chat_shape(row) -> tuple:
    """A chat row's roles in order, with each message's keys beyond role and content (and its
    "weight": a turn of weight 0 is not split out of the conversation)."""
    return tuple(
        m["role"]
        if len(m) == 2
        else (m["role"], m.get("weight"), *sorted(k for k, v in m.items() if v is not None))
        for m in row["messages"]
    )


def add_chat(chats: dict, row, index: int) -> None:
    """Records the good row `index` if it is the first of its conversation shape."""
    if "messages" in row and len(chats) < CHAT_SHAPES:
        chats.setdefault(_chat_shape(row), index)


class Row(dict):
    """A row dict that knows where it comes from (`origin`: "path:line" or "path: row n"; `path`:
    its file), so that a row the tokenizer refuses while training is named as at opening."""

    origin = path = ""

    def __reduce__(self):  # (pickled to worker processes with its origin)
        return located_row, (dict(self), self.origin, self.path)


def located_row(items: dict, origin: str, path: str) -> Row:
    row = Row(items)
    row.origin, row.path = origin, path
    return row
