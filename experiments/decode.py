r"""Generates with a trained run: translations or continuations of the given text.

    python experiments/decode.py --config=configs/translate.py:demo --workdir=/tmp/translate_demo \
        --input="4021" [--input="17" ...]
    python experiments/decode.py --config=configs/lm.py:pydoc --workdir=/tmp/lm_pydoc \
        --input_file=prompts.txt --method=sample --temperature=0.7 --format=jsonl
    echo "def main(" | python experiments/decode.py --config=configs/lm.py:pydoc --workdir=...

Give the same --config (and overrides) the run was trained with; a LoRA run's base is read
from --config.init_from, by default the place its config.json records. The newest checkpoint
that restores and verifies is loaded, as a resumed run would take it: a damaged newer one is
named and passed over, and left as it is (decoding writes nothing to the workdir). --step=N loads
step N (or fails naming it); --average_last=N averages the N steps up to it, as the paper does
with 5. Decoding options default to the config's `decode` section; flags override them. Every
option is checked before anything is loaded (a bad one: a line naming it, exit status 2).

One input per --input flag, per line of --input_file, or per line of stdin when neither is
given, as UTF-8. Prints one line per input, in order: with --format=text (the default)
`input<TAB>output`, where a backslash, a tab, a newline and every other control or
line-separating character is written as in a Python string (\\, \t, \n, \x0c, \u2028), so
that generated text never breaks the line; with --format=jsonl a JSON object
{"input": ..., "output": ...} (ASCII, everything else escaped). An input longer than the rows
the model was trained on (dataset.seq_len tokens) is decoded with a warning. A language model
generates within its max_len (its context length) after the longest input: a --max_new_tokens
past that is refused, naming the input and what fits; the config's value or the default is cut
to what fits, with a warning.
"""

import json
import os
import re
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfjax.runner import startup  # noqa: E402 - imports no JAX

startup.choose_platform()  # before anything imports JAX

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "The run's config file (configs/<family>.py[:preset,...]).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (its checkpoints/).")
_INPUT = flags.DEFINE_multi_string("input", [], "A source sentence or prompt (repeatable).")
_INPUT_FILE = flags.DEFINE_string("input_file", None, "A file with one input per line.")
_METHOD = flags.DEFINE_enum("method", None, ["greedy", "sample", "beam"], "Decoding method.")
_BEAM_SIZE = flags.DEFINE_integer("beam_size", None, "Beams (method=beam).")
_ALPHA = flags.DEFINE_float("alpha", None, "Length penalty exponent (method=beam).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Softmax temperature (method=sample).")
_TOP_K = flags.DEFINE_integer("top_k", None, "Keep the k most likely tokens (0: off).")
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus: the smallest set of mass p (1: off).")
_LAYOUT = flags.DEFINE_enum(
    "layout",
    None,
    ["auto", "replicated", "tensor", "as-given"],
    "The parameters' layout while generating (tfjax.decode.decode_layout).",
)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate per input.")
_AVERAGE = flags.DEFINE_integer(
    "average_last", None, "Average the N checkpoints up to the one decoded with."
)
_STEP = flags.DEFINE_integer(
    "step", None, "The checkpoint step to decode with (default: the newest that verifies)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_FORMAT = flags.DEFINE_enum(
    "format",
    "text",
    ["text", "jsonl"],
    "text: input<TAB>output per line, control characters escaped; jsonl: a JSON object "
    '{"input", "output"} per line.',
)
flags.mark_flags_as_required(["config", "workdir"])


def _utf8(data: bytes, where: str) -> str:
    """`data` as text, or a usage error naming `where` and its first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise app.UsageError(
            f"{where} is not UTF-8 text: byte {e.start} (line {line}) is 0x{data[e.start]:02x}. "
            "Give the inputs as UTF-8, e.g. convert a file with `iconv -f <its encoding> "
            "-t utf-8`."
        ) from None


def _lines(text: str) -> list[str]:
    """Lines end at a newline ("\r\n" too), nowhere else: a form feed is part of its line."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _inputs() -> tuple[list[str], list[str]]:
    """The non-empty inputs, and where each comes from ("line 3 of FILE") for messages."""
    if _INPUT.value and _INPUT_FILE.value:
        raise app.UsageError("give --input or --input_file, not both")
    if _INPUT_FILE.value:
        path = _INPUT_FILE.value
        if not os.path.isfile(path):
            raise app.UsageError(f"--input_file={path!r} does not exist")
        with open(path, "rb") as f:
            lines = _lines(_utf8(f.read(), f"--input_file={path!r}"))
        where = [f"line {i} of {path}" for i in range(1, len(lines) + 1)]
    elif _INPUT.value:
        # Python decodes argv with surrogateescape; os.fsencode gives back the bytes typed.
        lines = [_utf8(os.fsencode(x), f"--input #{i}") for i, x in enumerate(_INPUT.value, 1)]
        where = [f"--input #{i}" for i in range(1, len(lines) + 1)]
    else:
        lines = _lines(_utf8(sys.stdin.buffer.read(), "stdin"))
        where = [f"stdin line {i}" for i in range(1, len(lines) + 1)]
    keep = [i for i, line in enumerate(lines) if line.strip()]
    if not keep:
        raise app.UsageError("no input: give --input, --input_file or text on stdin")
    return [lines[i] for i in keep], [where[i] for i in keep]


# What --format=text escapes: a backslash, C0 and C1 controls (tab, newline, ...), and the
# separators that str.splitlines() also breaks lines at.
_ESCAPED = re.compile(r"[\\\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SHORT = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _one_line(text: str) -> str:
    """`text` with the characters of _ESCAPED written as in a Python string literal."""

    def escape(m):
        c = m.group()
        return _SHORT.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")

    return _ESCAPED.sub(escape, text)


def _output_line(text: str, output: str) -> str:
    if _FORMAT.value == "jsonl":
        return json.dumps({"input": text, "output": output})  # ASCII: nothing to break a line
    return f"{_one_line(text)}\t{_one_line(output)}"


def main(argv):
    from tfjax.runner import checkpoint

    startup.show_own_info_only()
    try:
        _decode(argv)
    except app.UsageError as e:  # a few lines naming the flag or input, not absl's whole help
        print(f"decode.py: {e}", file=sys.stderr)
        return 2
    except (
        ValueError,
        FileNotFoundError,
        NotADirectoryError,
        checkpoint.CheckpointError,  # unusable, mismatched or unreadable steps
    ) as e:
        # tfjax's checks of options, workdirs and checkpoints: their message says it all.
        print(f"decode.py: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


# --flag -> the field of the config's decode section that it overrides
_OVERRIDES = {
    "method": _METHOD,
    "beam_size": _BEAM_SIZE,
    "alpha": _ALPHA,
    "temperature": _TEMPERATURE,
    "top_k": _TOP_K,
    "top_p": _TOP_P,
    "layout": _LAYOUT,
    "max_new_tokens": _MAX_NEW,
    "average_last": _AVERAGE,
}


def _named(option: str) -> str:
    """Where an option's value comes from: "--top_p=1.5", or "decode.top_p=1.5 (the config)"."""
    flag = _OVERRIDES[option]
    if flag.value is not None:
        return f"--{option}={flag.value}"
    return f"decode.{option}={_CONFIG.value.decode[option]} (the config)"


def _option(name: str):
    flag = _OVERRIDES[name]
    return _CONFIG.value.decode[name] if flag.value is None else flag.value


def _decode(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    if config.task not in ("translation", "lm"):
        raise app.UsageError(
            f"task={config.task!r} does not generate text; decode.py runs translation and lm"
        )
    encoder_decoder = config.task == "translation"
    default_new = config.dataset.seq_len + 50 if encoder_decoder else 32  # the paper: input + 50
    options, max_new = _checked_options(default_new)
    texts, where = _inputs()
    _base_as_recorded(config)
    average_last = _option("average_last")
    kept = _checked_steps(average_last)

    import jax
    import numpy as np

    from tfjax import decode, progress
    from tfjax.tasks.decoding import eos_ids

    model, params, tokenizer = _restore(config, kept, average_last)
    ids = [tokenizer.encode(t) for t in texts]
    if encoder_decoder:
        ids = [np.append(x, tokenizer.eos_id) for x in ids]  # sources end with eos, as in training
    elif getattr(
        tokenizer, "add_bos", True
    ):  # rows start with bos (a checkpoint's: if it adds one)
        ids = [np.insert(x, 0, tokenizer.bos_id) for x in ids]
    for x, w in zip(ids, where, strict=True):
        # Training cut every row to seq_len tokens: later positions were never learned from.
        if len(x) > config.dataset.seq_len:
            logging.warning(
                "%s is %d tokens long, but the model was trained on at most %d "
                "(dataset.seq_len): its output for it is unreliable",
                w,
                len(x),
                config.dataset.seq_len,
            )
    if not encoder_decoder:
        max_new = _within_max_len(max_new, ids, where, model.max_len)
    method = options["method"]
    # Beam search over prompts needs equal lengths: decode groups of equal length together.
    groups = {}
    for i, x in enumerate(ids):
        groups.setdefault(len(x) if method == "beam" and not encoder_decoder else 0, []).append(i)
    outputs = [None] * len(ids)
    bar = progress.bar(total=len(ids), unit="input", desc="decoding")
    start, generated = time.perf_counter(), 0
    eos = eos_ids(tokenizer)
    for members in groups.values():
        width = max(len(ids[i]) for i in members)
        batch = np.zeros((len(members), width), np.int32)
        mask = np.zeros((len(members), width), bool)  # right padding (a source's: its own, 0)
        for row, i in enumerate(members):
            batch[row, : len(ids[i])], mask[row, : len(ids[i])] = ids[i], True
        tokens, _ = decode.generate(
            model,
            params,
            batch,
            mask=None if encoder_decoder else mask,
            max_new_tokens=max_new,
            eos_id=eos,
            rng=jax.random.key(_SEED.value),
            **options,
        )
        tokens = np.asarray(tokens)
        # Each output ends before its first EOS of any id; after it come filler ids.
        ends = decode.first_eos(tokens, eos)
        for row, i in enumerate(members):
            outputs[i] = tokenizer.decode(tokens[row, : ends[row]])
            generated += min(int(ends[row]) + 1, tokens.shape[1])  # the EOS counts
        bar.update(len(members))
    bar.close()
    logging.info(
        "Decoded %d inputs: %s generated",
        len(ids),
        progress.throughput(generated, "tokens", time.perf_counter() - start),
    )
    for text, out in zip(texts, outputs, strict=True):
        print(_output_line(text, out), flush=True)


def _checked_options(default_new: int) -> tuple[dict, int]:
    """The generation options (flags over the config's decode section) and max_new_tokens,
    checked as `tfjax.decode.generate` checks them, before anything is loaded."""
    from tfjax import decode

    if _MAX_NEW.value is not None and _MAX_NEW.value < 0:
        raise app.UsageError(
            f"--max_new_tokens={_MAX_NEW.value}: give the number of tokens to generate per input "
            f"(at least 1), or 0 for the default ({default_new})"
        )
    max_new = _option("max_new_tokens") or default_new
    names = ("method", "beam_size", "alpha", "temperature", "top_k", "top_p", "layout")
    options = {name: _option(name) for name in names}
    checked = {k: v for k, v in options.items() if k != "alpha"}  # alpha: any number
    try:
        decode.check_options(max_new_tokens=max_new, **checked)
    except decode.OptionError as e:
        raise app.UsageError(f"{_named(e.option)}: {e}") from None
    return options, max_new


def _within_max_len(max_new: int, ids: list, where: list[str], max_len: int) -> int:
    """max_new_tokens for prompts `ids` within the model's max_len (its context length), after
    the longest: a --max_new_tokens past it is refused by name; the config's value or the
    default is cut to what is left, with a line saying so."""
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    length, room = len(ids[longest]), max_len - len(ids[longest])
    what = f"{where[longest]} is {length} tokens long, and the model's max_len={max_len}"
    if room < 1:
        raise app.UsageError(f"{what} leaves no room to generate; give a shorter input")
    if max_new <= room:
        return max_new
    if _MAX_NEW.value:  # asked for by name: refused, not cut
        raise app.UsageError(
            f"--max_new_tokens={max_new}: {what} leaves room for {room}; give "
            f"--max_new_tokens={room} or less, or a shorter input"
        )
    given = _named("max_new_tokens") if _option("max_new_tokens") else None
    logging.warning(
        "%s: %s leaves room for %d; generating at most %d per input",
        given or f"max_new_tokens={max_new} (the default)",
        what,
        room,
        room,
    )
    return room


def _base_as_recorded(config) -> None:
    """A LoRA run from a Hugging Face checkpoint keeps only its adapters; their base is read
    from config.init_from. Where --config leaves it unset, the place the run recorded (its
    config.json) is taken, as export.py takes it; the base there is checked to be the one the
    adapters were trained on (`tfjax.runner.pretrained.check_base`)."""
    from tfjax.runner import workdirs

    if config.get("init_from") or "init_from" not in config:
        return
    stored = workdirs.previous_config(_WORKDIR.value) or {}
    recorded, lora = stored.get("init_from"), stored.get("lora") or {}
    if recorded and lora.get("rank"):
        config.init_from = recorded
        logging.info(
            "config.init_from is unset: the base of this LoRA run's adapters is read from %s, "
            "as its config.json records",
            recorded,
        )


def _checked_steps(average_last: int) -> list[int]:
    """The workdir's kept steps, with --step and average_last checked against them ([] when
    it keeps none: restoring then says so)."""
    from tfjax.runner import checkpoint

    if average_last < 1:
        raise app.UsageError(f"{_named('average_last')}: average at least 1 checkpoint")
    if _STEP.value is not None and _STEP.value < 0:
        raise app.UsageError(f"--step={_STEP.value}: steps are numbered from 0")
    directory = checkpoint.checkpoints_dir(_WORKDIR.value)
    if not os.path.isdir(directory):
        return []
    manager = checkpoint.make_manager(directory, read_only=True)
    try:
        kept = sorted(manager.all_steps())
    finally:
        manager.close()
    if not kept:
        return []
    end = kept[-1] if _STEP.value is None else _STEP.value
    if end not in kept:
        raise app.UsageError(f"--step={end}: {directory} keeps steps {kept}")
    window = kept[: kept.index(end) + 1]
    if len(window) < average_last:
        raise app.UsageError(
            f"{_named('average_last')}: {directory} keeps {len(window)} checkpoints up to step "
            f"{end} ({window}); average fewer, or keep more when training (checkpoint.keep)"
        )
    return kept


def _restore(config, kept: list[int], average_last: int):
    """(model, params, tokenizer) of --step, or of the newest step that restores and verifies
    (the one a resumed run takes): a step that fails is named, left as it is, and the next
    older one tried. With average_last=N, the N kept steps up to the step."""
    from tfjax.runner import checkpoint, train

    if _STEP.value is not None or not kept:  # that step or nothing: its error is the answer
        return train.restore_model(
            config, _WORKDIR.value, average_last=average_last, step=_STEP.value
        )
    directory = checkpoint.checkpoints_dir(_WORKDIR.value)
    tried = []
    for i in range(len(kept) - 1, average_last - 2, -1):
        step = kept[i]
        try:
            restored = train.restore_model(
                config, _WORKDIR.value, average_last=average_last, step=step
            )
        except checkpoint.UnusableCheckpointError as e:
            logging.error(
                "Checkpoint unusable: %s. Its files are left as they are; trying an older step.",
                e,
            )
            tried.append(step)
            continue
        if tried:
            logging.warning(
                "Decoding with checkpoint %s/%d, the newest that verifies.", directory, step
            )
        return restored
    each = f" (each averaged with the {average_last - 1} before it)" if average_last > 1 else ""
    raise checkpoint.UnusableCheckpointError(
        f"no checkpoint in {directory} restores and verifies: tried steps {tried}{each}, each "
        "named above; nothing was moved or deleted"
    )


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, after refusing --config given more than once: the last one would win
    silently, or absl names a field's override flag as "defined twice"."""
    given = []
    for i, arg in enumerate(argv[1:], 2):
        if arg == "--":
            break
        name, equals, value = arg.partition("=")
        if name in ("--config", "-config"):
            given.append(value if equals else " ".join(argv[i : i + 1]))
    if len(given) > 1:
        print(
            f"decode.py: --config given {len(given)} times ({', '.join(given)}); give it once: "
            "presets are comma-separated in it, as in --config=configs/finetune.py:lora,tiny",
            file=sys.stderr,
        )
        sys.exit(2)
    return app.parse_flags_with_usage(argv)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
