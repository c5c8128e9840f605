"""Rows -> training examples: `row_format` tells a row's format, `encode_row` encodes it into
tokens and the weights the loss trains (the package docstring says how, format by format)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from tfjax.data.checkpoint_tokenizer.chat_template import template_messages
from tfjax.data.checkpoint_tokenizer.tokenizer import CheckpointTokenizer

ROW_FORMATS = ("text", "prompt_completion", "messages")


def row_format(row: Mapping[str, Any]) -> str:
    """Which of ROW_FORMATS a row is: "messages" if it has messages, else "prompt_completion"
    if it has a completion or a prompt (and no text), else "text" (see the package docstring)."""
    if not isinstance(row, Mapping):
        raise ValueError(f"a row must be a dict, got {type(row).__name__}.")
    if "messages" in row:
        return "messages"
    if "completion" in row or ("prompt" in row and "text" not in row):
        return "prompt_completion"
    if "text" in row:
        return "text"
    raise ValueError(
        "a row needs 'text', 'prompt' and 'completion', or 'messages'; it has "
        f"{sorted(map(str, row)) or 'no keys'}."
    )


def encode_row(tokenizer: CheckpointTokenizer, row: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """One row -> {"tokens": int32 [L], "weights": float32 [L]}; weights is 1.0 on the tokens
    the loss trains on (see the package docstring for each format)."""
    fmt = row_format(row)
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    if fmt == "text":
        body = _encode_field(tokenizer, row, "text")
        tokens = bos + body + [tokenizer.eos_id]
        weights = [0.0] + [1.0] * (len(tokens) - 1)
    elif fmt == "prompt_completion":
        prompt = bos + _encode_field(tokenizer, row, "prompt")
        completion = _encode_field(tokenizer, row, "completion") + [tokenizer.eos_id]
        tokens = prompt + completion
        weights = [0.0] * len(prompt) + [1.0] * len(completion)
    else:
        tokens, weights = _encode_messages(tokenizer, row["messages"])
    return {"tokens": np.asarray(tokens, np.int32), "weights": np.asarray(weights, np.float32)}


def _encode_field(tokenizer: CheckpointTokenizer, row: Mapping[str, Any], key: str) -> list[int]:
    if row.get(key) is None:
        raise ValueError(f"a {row_format(row)} row needs {key!r}; it has {sorted(map(str, row))}.")
    value = row[key]
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {type(value).__name__}.")
    return tokenizer._backend.encode(value)[0]


def _encode_messages(tokenizer: CheckpointTokenizer, messages: Any) -> tuple[list, list]:
    messages = _checked_messages(messages)
    whole = tokenizer.render_chat(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("'messages' has no 'assistant' turn: nothing to train on.")
    spans = []  # [start, end) character spans of the trained assistant turns in `whole`
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message_weight(message):
            continue
        before = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        through = tokenizer.render_chat(messages[: i + 1])
        # The turn starts where the two part; a generation prompt may end with whitespace that
        # the turn's rendering lacks (templates written without {{- }} often do).
        start = len(os.path.commonprefix([before, through]))
        if before[start:].strip():
            raise ValueError(
                f"the chat template cannot be split into turns: messages[:{i}] rendered with "
                f"add_generation_prompt=True is not a prefix of messages[:{i + 1}] rendered, "
                "up to trailing whitespace (its "
                "generation prompt differs from how it starts an assistant turn, or it renders "
                "earlier messages differently depending on what follows)."
            )
        if not whole.startswith(through):
            raise ValueError(
                f"the chat template cannot be split into turns: it renders messages[:{i + 1}] "
                "differently inside the whole conversation (it rewrites earlier turns, e.g. drops "
                "their reasoning as Qwen3's does); split the conversation into one row per "
                "assistant turn."
            )
        # The turn is what the template writes after the generation prompt: the content and the
        # end-of-turn token(s). Whitespace around them that is not the content's own is the
        # template's layout, left untrained.
        content = message["content"]
        if not (content and through.startswith(content, start)):
            start = len(through) - len(through[start:].lstrip())
        end = len(through.rstrip())
        if content and through.rfind(content, start) >= 0:
            end = max(end, through.rfind(content, start) + len(content))
        spans.append((start, max(end, start)))
    ids, offsets = tokenizer._backend.encode(whole)
    weights = [0.0] * len(ids)
    k = 0  # spans and offsets are both in order: one pass
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        # A token overlapping the turn is trained; so is a zero-width one inside it
        # (SentencePiece's dummy prefix "▁" at the start of a piece of text).
        if start < spans[k][1] and (end > spans[k][0] or start == end >= spans[k][0]):
            weights[t] = 1.0
    tokens = tokenizer._with_bos(ids, whole)
    weights = [0.0] * (len(tokens) - len(ids)) + weights
    return tokens, weights


def _checked_messages(messages: Any) -> list[dict]:
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    if not isinstance(messages, (list, tuple)):
        raise ValueError(
            "'messages' must be a list of {'role', 'content'} dicts, "
            f"got {type(messages).__name__}."
        )
    if not messages:
        raise ValueError("'messages' is empty.")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}.")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise ValueError(f"messages[{i}] has no {key!r}.")
            if not isinstance(message[key], str):
                raise ValueError(
                    f"messages[{i}][{key!r}] must be a string, got {type(message[key]).__name__}."
                )
        try:
            message_weight(message)
        except ValueError as e:
            raise ValueError(f"messages[{i}]: {e}") from None
    return template_messages(messages)


def message_weight(message: Mapping[str, Any]) -> int:
    """A message's "weight" as OpenAI's chat fine-tuning format defines it: on an assistant
    message, 1 (its turn is trained; also when absent or null) or 0 (not trained); a ValueError
    for any other value, or for a weight on a message of another role (whose turn is never
    trained)."""
    weight = message.get("weight")
    if weight is None:
        return 1
    if message.get("role") != "assistant":
        raise ValueError(
            f"'weight' is allowed only on an assistant message (0: its turn is not trained, "
            f"1: trained); this one's role is {message.get('role')!r}, whose turn is never "
            "trained: remove its weight"
        )
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float, np.number))
        or weight not in (0, 1)
    ):
        raise ValueError(
            f"'weight' must be 0 (the assistant turn is not trained) or 1 (trained), got {weight!r}"
        )
    return int(weight)
