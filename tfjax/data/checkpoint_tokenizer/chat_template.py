"""Chat templates as transformers renders them: jinja2's immutable sandbox with its globals and
filters (see the package docstring), and messages as a template sees them."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import numpy as np

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def template_messages(messages: Any) -> list[dict]:
    """Messages as a template sees them: plain data, keys whose value is None dropped, and the
    reasoning under each name templates read (transformers does the same)."""
    messages = plain_data(messages)
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}.")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}.")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def plain_data(value: Any) -> Any:
    """Only JSON-like types reach the sandbox: numpy values become Python ones, anything else
    a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.ndarray):
        return plain_data(value.tolist())
    if isinstance(value, np.generic):
        return plain_data(value.item())
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    return _environment().from_string(source)


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: transformers' marker of assistant text, which
        some templates carry; here it renders as its body."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(format):
        return datetime.now().strftime(format)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    class GuardedDict:
        """`dict(...)` and `dict.fromkeys(...)` without the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def refuse_private(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set underscore names on a namespace ({name!r})"
            )

    class GuardedNamespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing underscore-prefixed attributes."""

        def __init__(*args, **kwargs):  # jinja2's signature: `self` may be a keyword too
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                refuse_private(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            refuse_private(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=GuardedDict(),
        namespace=GuardedNamespace,
    )
    return env
