"""The one reader of a JSON object that a file holds: a file that is not valid JSON, or holds
another JSON value, is a ValueError of one line naming the file, what it is and what to do.

    config = jsonfile.read_object(path, "a checkpoint's config.json")

Only the standard library is imported: the data readers, the tokenizers and the converters all
read their JSON files through it.
"""

import json


def parse_object(text: str | bytes, where: str, what: str, fix: str) -> dict:
    """The JSON object in `text`, read from `where` (named in messages); `what` it is and the
    `fix` complete the message."""
    try:
        value = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{where} is not valid JSON ({e}); {what} is a JSON object: {fix}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{where} holds a JSON {type(value).__name__}; {what} is a JSON object: {fix}"
        )
    return value


def read_object(path: str, what: str, fix: str = "download or write it again") -> dict:
    """The JSON object in file `path` (`what` it is, for messages)."""
    with open(path, "rb") as f:
        return parse_object(f.read(), path, what, fix)
