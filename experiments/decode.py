r"""Generates with a trained run: translations or continuations of the given text.

    python experiments/decode.py --config=configs/translate.py:demo --workdir=/tmp/translate_demo \
        --input="4021" [--input="17" ...]
    python experiments/decode.py --config=configs/lm.py:pydoc --workdir=/tmp/lm_pydoc \
        --input_file=prompts.txt --method=sample --temperature=0.7
    echo "def main(" | python experiments/decode.py --config=configs/lm.py:pydoc --workdir=...

Give the same --config (and overrides) the run was trained with. The newest checkpoint is
loaded (--average_last=N averages the newest N, as the paper does with 5). Decoding options
default to the config's `decode` section; flags override them. One input per --input flag, per
line of --input_file, or per line of stdin when neither is given, as UTF-8. Prints one line per
input: `input<TAB>output`; an input longer than the rows the model was trained on
(dataset.seq_len tokens) is decoded with a warning.
"""

import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate per input.")
_AVERAGE = flags.DEFINE_integer("average_last", None, "Average the newest N checkpoints.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
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


def _inputs() -> tuple[list[str], list[str]]:
    """The non-empty inputs, and where each comes from ("line 3 of FILE") for messages."""
    if _INPUT.value and _INPUT_FILE.value:
        raise app.UsageError("give --input or --input_file, not both")
    if _INPUT_FILE.value:
        path = _INPUT_FILE.value
        if not os.path.isfile(path):
            raise app.UsageError(f"--input_file={path!r} does not exist")
        with open(path, "rb") as f:
            lines = _utf8(f.read(), f"--input_file={path!r}").splitlines()
        where = [f"line {i} of {path}" for i in range(1, len(lines) + 1)]
    elif _INPUT.value:
        # Python decodes argv with surrogateescape; os.fsencode gives back the bytes typed.
        lines = [_utf8(os.fsencode(x), f"--input #{i}") for i, x in enumerate(_INPUT.value, 1)]
        where = [f"--input #{i}" for i in range(1, len(lines) + 1)]
    else:
        lines = _utf8(sys.stdin.buffer.read(), "stdin").splitlines()
        where = [f"stdin line {i}" for i in range(1, len(lines) + 1)]
    keep = [i for i, line in enumerate(lines) if line.strip()]
    if not keep:
        raise app.UsageError("no input: give --input, --input_file or text on stdin")
    return [lines[i] for i in keep], [where[i] for i in keep]


def _option(flag, config_value):
    return config_value if flag.value is None else flag.value


def main(argv):
    from tfjax.runner import checkpoint

    try:
        _decode(argv)
    except app.UsageError as e:  # a few lines naming the flag or input, not absl's whole help
        print(f"decode.py: {e}", file=sys.stderr)
        return 2
    except (
        ValueError,
        FileNotFoundError,
        NotADirectoryError,
        checkpoint.UnusableCheckpointError,
    ) as e:
        # tfjax's checks of options, workdirs and checkpoints: their message says it all.
        print(f"decode.py: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


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
    if _MAX_NEW.value is not None and _MAX_NEW.value < 0:
        raise app.UsageError(
            f"--max_new_tokens={_MAX_NEW.value}: give the number of tokens to generate per input "
            f"(at least 1), or 0 for the default ({default_new})"
        )
    texts, where = _inputs()
    d = config.decode
    method = _option(_METHOD, d.method)
    average_last = _option(_AVERAGE, d.average_last)

    import jax
    import numpy as np

    from tfjax import decode, progress
    from tfjax.runner import train
    from tfjax.tasks.decoding import eos_ids

    model, params, tokenizer = train.restore_model(
        config, _WORKDIR.value, average_last=average_last
    )
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
    max_new = _option(_MAX_NEW, d.max_new_tokens) or default_new
    if not encoder_decoder:
        max_new = min(max_new, model.max_len - max(len(x) for x in ids))
        if max_new < 1:
            raise app.UsageError(
                f"the longest prompt has {max(len(x) for x in ids)} tokens; the model's "
                f"max_len={model.max_len} leaves no room to generate"
            )
    options = dict(
        method=method,
        beam_size=_option(_BEAM_SIZE, d.beam_size),
        alpha=_option(_ALPHA, d.alpha),
        temperature=_option(_TEMPERATURE, d.temperature),
        top_k=_option(_TOP_K, d.top_k),
        top_p=_option(_TOP_P, d.top_p),
    )
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
        print(f"{text}\t{out}", flush=True)


if __name__ == "__main__":
    app.run(main)
