"""Decoding in the runner: BLEU and samples in eval, experiments/decode.py, checkpoint averaging."""

import json
import os
import shutil
import subprocess
import sys
import unicodedata

import jax
import numpy as np
import pytest
from conftest import ROOT, own_info_lines

import tfjax.data
from tfjax import decode
from tfjax.models import decoder, transformer
from tfjax.runner import checkpoint, evaluation, metrics, train
from tfjax.tasks import translation


def tiny(spec, data_dir, **fields):
    config = train.load_config(os.path.join(ROOT, spec))
    config.data_dir = data_dir
    config.update(fields)
    return config


@pytest.fixture(scope="module")
def translate_run(data_dir, tmp_path_factory):
    """The tiny translation config on a data=4 mesh, checkpoints at steps 2, 3 and 4."""
    workdir = str(tmp_path_factory.mktemp("translate"))
    config = tiny("configs/translate.py:tiny", data_dir, num_train_steps=4, eval_every=2)
    config.mesh.data = 4
    config.checkpoint.update(every=1, keep=3, best_metric="")
    train.train_and_evaluate(config, workdir, devices=jax.devices()[:4])
    return config, workdir


def test_translation_eval_logs_bleu_and_samples(translate_run):
    config, workdir = translate_run
    evals = metrics.read_metrics(workdir, "eval")
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0.0 <= r["bleu"] <= 100.0 for r in evals)
    with open(os.path.join(workdir, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 2 * config.decode.num_samples
    assert {"step", "output", "reference"} <= set(samples[0])
    assert all(s["reference"] for s in samples)  # detokenised real rows, not padding


def test_corpus_bleu_bounds():
    refs = ["four thousand two hundred twenty-one", "seventeen", "one hundred two thousand five"]
    assert translation.corpus_bleu(refs, refs) == pytest.approx(100.0)
    assert translation.corpus_bleu(["x y z"] * 3, refs) == 0.0


@pytest.fixture(scope="module")
def lm_run(data_dir, tmp_path_factory):
    """The tiny language model config (max_len 256), trained 2 steps."""
    workdir = str(tmp_path_factory.mktemp("lm"))
    config = tiny("configs/lm.py:tiny", data_dir)
    train.train_and_evaluate(config, workdir, devices=jax.devices()[:1])
    return config, workdir


def test_lm_eval_writes_samples(lm_run):
    config, workdir = lm_run
    with open(os.path.join(workdir, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == config.decode.num_samples
    assert all(s["step"] == 2 and s["prompt"] for s in samples)


def test_workdir_keeps_the_sentencepiece_model_it_was_trained_with(tmp_path):
    data_dir, workdir = str(tmp_path / "data"), str(tmp_path / "run")
    config = tiny("configs/lm.py:tiny", data_dir)
    config.dataset.update(tokenizer="sentencepiece", vocab_size=600)
    train.train_and_evaluate(config, workdir, devices=jax.devices()[:1])
    data_model = tfjax.data.tokenizer_path(tfjax.data.dataset_spec(config), data_dir)
    stored = os.path.join(workdir, train.TOKENIZER_FILE)
    with open(stored, "rb") as f, open(data_model, "rb") as g:
        assert f.read() == g.read()

    # Decoding needs only the workdir: the dataset's tokenizer may be gone (another machine).
    os.remove(data_model)
    _, _, tokenizer = train.restore_model(config, workdir, devices=jax.devices()[:1])
    assert tokenizer.path == stored
    assert tokenizer.decode(tokenizer.encode("def f(x):")) == "def f(x):"

    # Resuming with another SentencePiece model is refused before anything is written.
    texts = ["a completely different corpus of words, numbers 12345 and symbols %$#"] * 50
    tfjax.data.tokenizers.train_sentencepiece(texts, data_model, vocab_size=400)
    before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    config.num_train_steps = 4
    with pytest.raises(ValueError, match=f"trained with the SentencePiece model {stored}"):
        train.train_and_evaluate(config, workdir, devices=jax.devices()[:1])
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before
    with open(stored, "rb") as f, open(data_model, "rb") as g:
        assert f.read() != g.read()  # the workdir's copy is untouched


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_unchecked_generate_matches_checked(method):
    """check=False (global arrays in the runner) gives the tokens of the checked path."""
    rng = np.random.default_rng(0)
    for model in (
        transformer.Model(variant="tiny", vocab_size=40),
        decoder.Model(variant="tiny", vocab_size=40, max_len=32),
    ):
        inputs = rng.integers(0, 40, size=(3, 6)).astype(np.int32)
        args = (inputs, inputs) if hasattr(model, "encode") else (inputs,)
        params = model.init(jax.random.key(1), *args)["params"]
        kw = dict(max_new_tokens=5, eos_id=(2, 3), method=method, beam_size=2)
        if method == "greedy" and not hasattr(model, "encode"):
            # A right- and a left-padded prompt: lengths and alignment found on the device.
            kw["mask"] = np.ones(inputs.shape, bool)
            kw["mask"][1, 4:] = kw["mask"][2, :3] = False
        want = decode.generate(model, params, inputs, **kw)
        got = decode.generate(model, params, jax.numpy.asarray(inputs), check=False, **kw)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5)


def test_lm_samples_take_their_prompts_from_the_weights_not_the_ids():
    """SamplesEval's prompts: the tokens before a row's first weighted one (prompt/completion,
    chat), or plain text's first prompt_length; id 0 is a token like any other."""
    import types

    import ml_collections

    from tfjax.tasks import lm

    tokens = np.array(
        [
            [1, 0, 7, 8, 9, 2, 0, 0],  # prompt [1, 0, 7], completion [8, 9, 2], padding
            [1, 5, 0, 6, 7, 8, 9, 2],  # plain text
            [1, 4, 5, 6, 7, 8, 9, 2],  # a longer prompt: its last 3 tokens
            [1, 3, 3, 0, 0, 0, 0, 0],  # nothing weighted after position 0: dropped
            [1, 9, 1, 8, 8, 8, 2, 0],  # packed: its first segment [1, 9], plain text
        ]
    )
    weights = np.array(
        [
            [0, 0, 0, 1, 1, 1, 0, 0],
            [0, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0, 1, 1],
            [1, 0, 0, 0, 0, 0, 0, 0],
            [0, 1, 0, 1, 1, 1, 1, 0],
        ],
        np.float32,
    )
    segments = np.ones_like(tokens)
    segments[0, 6:] = segments[3, 3:] = segments[4, 7] = 0
    segments[4, 2:7] = 2
    rows, mask = lm.sample_prompts(tokens, weights, segments, 3)
    assert rows.tolist() == [[1, 0, 7], [1, 5, 0], [6, 7, 8], [0, 1, 9]]
    assert mask.tolist() == [[True] * 3] * 3 + [[False, True, True]]
    unpacked = lm.sample_prompts(tokens[:4], weights[:4], None, 3)
    np.testing.assert_array_equal(unpacked[0], rows[:3])
    rows, mask = lm.sample_prompts(tokens, weights, segments, 3, equal_lengths=True)  # beam
    assert rows.tolist() == [[0, 7], [5, 0], [7, 8], [1, 9]] and mask.all()

    d = ml_collections.ConfigDict(
        dict(num_samples=2, prompt_length=3, max_new_tokens=4, method="greedy", beam_size=4)
    )
    d.update(alpha=None, temperature=1.0, top_k=0, top_p=1.0, layout="auto")
    exp = types.SimpleNamespace(model=types.SimpleNamespace(max_len=64), replicated=None)
    # Without "weights" (a hand-made batch) every position is real and weighted: plain text.
    rows, kwargs = lm.SamplesEval(d, 0).generate_args(exp, {"tokens": tokens})
    assert rows.tolist() == [[1, 0, 7], [1, 5, 0]] and kwargs["mask"].all()
    abstract = {"tokens": jax.ShapeDtypeStruct(tokens.shape, np.int32)}
    rows, kwargs = lm.SamplesEval(d, 0).generate_args(exp, abstract)
    assert rows.shape == kwargs["mask"].shape == (2, 3) and kwargs["max_new_tokens"] == 4


def eval_spec(config) -> dict:
    """The eval batches of `config` as check_decode and the sample decode see them."""
    return tfjax.data.element_spec(tfjax.data.dataset_spec(config), config.eval_batch_size)


@pytest.mark.parametrize(
    "fields, max_len, message",
    [
        # The step-0 evaluation's traceback: "inputs (2, 0) have no tokens".
        (dict(prompt_length=0), 256, "decode.prompt_length=0: each eval sample continues"),
        # A 16-position checkpoint: "max_new_tokens must be at least 1, got 0", the wrong field.
        (
            {},
            16,
            "decode.prompt_length=16 + decode.max_new_tokens=8 = 24 tokens exceed the model's "
            "max_len=16 (its context length); make them sum to at most 16: "
            "decode.prompt_length=8 or less\n",
        ),
        (
            dict(max_new_tokens=0),
            16,
            "decode.prompt_length=16 fills the model's max_len=16 (its context length), leaving "
            "no room to generate; give decode.prompt_length=15 or less",
        ),
        # Cut to 4 new tokens without a word.
        (
            {},
            20,
            "decode.prompt_length=16 + decode.max_new_tokens=8 = 24 tokens exceed the model's "
            "max_len=20 (its context length); make them sum to at most 20: "
            "decode.max_new_tokens=4 or less, or decode.prompt_length=12 or less",
        ),
        (
            dict(prompt_length=100, max_new_tokens=70),
            70,
            "decode.prompt_length=100 (cut to the eval rows' 64 tokens) + "
            "decode.max_new_tokens=70 = 134 tokens exceed the model's max_len=70 (its context "
            "length); make them sum to at most 70: decode.max_new_tokens=6 or less\n",
        ),
    ],
)
def test_lm_samples_that_do_not_fit_the_model_are_refused_by_name(fields, max_len, message):
    """evaluation.check_decode, made before any work: a language model's eval samples need a
    prompt and room for decode.max_new_tokens in the model's max_len (finetune.py's tiny
    preset: prompts of 16 tokens, 8 new ones, eval rows of 64)."""
    config = tiny("configs/finetune.py:tiny", "")
    config.decode.update(fields)
    model = decoder.Model(variant="tiny", vocab_size=40, max_len=max_len)
    with pytest.raises(ValueError) as e:
        evaluation.check_decode(config, model, eval_spec(config))
    assert f"{e.value}\n".startswith(message), e.value


def test_lm_samples_that_fit_the_model_are_decoded_as_set():
    """What check_decode accepts the sample decode takes whole: its max_new_tokens is the
    config's, not cut; the default (0) takes what is left up to 32; no samples, or a task that
    continues no prompts, ask nothing of prompt_length."""
    import types

    from tfjax.tasks import lm

    config = tiny("configs/finetune.py:tiny", "")
    abstract = eval_spec(config)
    for max_new, max_len, generated in ((8, 24, 8), (0, 17, 1), (0, 64, 32)):
        config.decode.max_new_tokens = max_new
        model = decoder.Model(variant="tiny", vocab_size=40, max_len=max_len)
        evaluation.check_decode(config, model, abstract)
        exp = types.SimpleNamespace(model=model, replicated=None)
        _, kwargs = lm.SamplesEval(config.decode, 0).generate_args(exp, abstract)
        assert kwargs["max_new_tokens"] == generated
    config.decode.update(prompt_length=0, num_samples=0)
    evaluation.check_decode(config, model, abstract)
    translation_config = tiny("configs/translate.py:tiny", "")
    translation_config.decode.prompt_length = 0
    model = transformer.Model(variant="tiny", vocab_size=40)
    evaluation.check_decode(translation_config, model, eval_spec(translation_config))


def test_average_last_is_the_mean_of_the_newest_checkpoints(translate_run):
    config, workdir = translate_run
    model, newest, _ = train.restore_model(config, workdir, devices=jax.devices()[:4])
    _, averaged, _ = train.restore_model(config, workdir, average_last=2, devices=jax.devices()[:4])
    manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"), read_only=True)
    assert sorted(manager.all_steps()) == [2, 3, 4]
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), newest
    )
    step3 = manager.restore(
        3,
        args=checkpoint.ocp.args.Composite(
            params=checkpoint.ocp.args.PyTreeRestore(
                target, restore_args=checkpoint.ocp.checkpoint_utils.construct_restore_args(target)
            )
        ),
    )["params"]
    manager.close()
    for a, b, c in zip(*map(jax.tree.leaves, (averaged, newest, step3)), strict=True):
        np.testing.assert_allclose(a, (np.asarray(b) + np.asarray(c)) / 2, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="average_last=4 but .* keeps only 3"):
        train.restore_model(config, workdir, average_last=4, devices=jax.devices()[:4])


def decode_cli(workdir, data_dir, *args, stdin=None, config="configs/translate.py:tiny", env=None):
    return subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "experiments/decode.py"),
            "--config=" + os.path.join(ROOT, config),
            f"--config.data_dir={data_dir}",
            f"--workdir={workdir}",
            *args,
        ],
        capture_output=True,
        text=not isinstance(stdin, bytes),
        input=stdin,
        timeout=300,
        env=env,
    )


def one_line(text: str) -> str:
    """decode.py's --format=text field: a backslash, C0 and C1 controls, U+2028 and U+2029
    written as in a Python string."""
    short = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}
    return "".join(
        short.get(c)
        or (f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" else None)
        or (f"\\u{ord(c):04x}" if c in "\u2028\u2029" else c)
        for c in text
    )


def test_decode_cli_translates_each_input(translate_run, data_dir, tmp_path):
    """One output line per input whatever the text holds (a tab, a form feed, a generated
    newline); --step picks the checkpoint. As a user runs it: no JAX_PLATFORMS set, so the
    CUDA plugin and libtpu installed here must not be started (and fail noisily)."""
    _, workdir = translate_run
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    args = ("--input=4021", "--input=x\ty", "--max_new_tokens=6", "--step=2")
    out = decode_cli(workdir, data_dir, *args, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["4021", "x\\ty"]
    assert all(line.count("\t") == 1 for line in lines)
    info = own_info_lines(out.stderr)
    assert any(f"Restored the parameters of {workdir}/checkpoints/2" in line for line in info)
    for noise in ("Jax plugin configuration error", "TPU_WORKER_HOSTNAMES", "host bounds"):
        assert noise not in out.stderr

    # Sampled at a high temperature, outputs hold every byte: newlines, tabs, controls.
    inputs = ["5", "12", "a\x0cb"] + [str(n) for n in range(30)]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5\n\n12\na\x0cb\n" + "".join(f"{n}\n" for n in range(30)))
    sample = ("--method=sample", "--temperature=1000", "--max_new_tokens=100")
    out = decode_cli(workdir, data_dir, f"--input_file={prompts}", *sample)
    assert out.returncode == 0, out.stderr
    text = [line.split("\t") for line in out.stdout.splitlines()]
    assert [len(fields) for fields in text] == [2] * len(inputs)
    assert [fields[0] for fields in text] == [one_line(x) for x in inputs]

    # The same from stdin as JSON lines: the text form is these outputs, escaped.
    out = decode_cli(workdir, data_dir, *sample, "--format=jsonl", stdin=prompts.read_text())
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["input"] for r in rows] == inputs
    assert [one_line(r["output"]) for r in rows] == [fields[1] for fields in text]
    assert any("\n" in r["output"] for r in rows) and any("\t" in r["output"] for r in rows)


def assert_short_error(out, message):
    """Exit status 2 and the message, without a traceback or absl's help on every flag."""
    stderr = out.stderr if isinstance(out.stderr, str) else out.stderr.decode()
    assert out.returncode == 2, stderr
    assert message in stderr and "Traceback" not in stderr and "--top_p" not in stderr, stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--input=1", "--method=sample", "--config.decode.top_p=1.5"],
            "decode.top_p=1.5 (the config): top_p must be in (0, 1], got 1.5",
        ),
        (
            ["--input=1", "--method=beam", "--beam_size=0"],
            "--beam_size=0: beam_size must be at least 1, got 0",
        ),
        (["--input_file=/nonexistent.txt"], "--input_file='/nonexistent.txt' does not exist"),
        (["--input=1", "--step=-1"], "--step=-1: steps are numbered from 0"),
        # absl said "The flag 'config.decode.top_k' is defined twice"; without an override
        # flag, the last --config won silently.
        (
            ["--config=configs/lm.py:tiny", "--config.decode.top_k=2", "--input=1"],
            f"decode.py: --config given 2 times ({ROOT}/configs/translate.py:tiny, "
            "configs/lm.py:tiny); give it once: presets are comma-separated in it",
        ),
    ],
)
def test_decode_cli_checks_options_before_loading(data_dir, tmp_path, args, message):
    """An empty workdir: the option, not the missing checkpoint, is what is reported."""
    assert_short_error(decode_cli(tmp_path, data_dir, *args), message)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--step=7"], "--step=7: {checkpoints} keeps steps [2, 3, 4]"),
        (
            ["--step=3", "--average_last=3"],
            "--average_last=3: {checkpoints} keeps 2 checkpoints up to step 3 ([2, 3]); "
            "average fewer",
        ),
    ],
)
def test_decode_cli_checks_steps_against_the_workdir(translate_run, data_dir, args, message):
    workdir = translate_run[1]
    out = decode_cli(workdir, data_dir, "--input=1", *args)
    assert_short_error(out, message.format(checkpoints=os.path.join(workdir, "checkpoints")))
    assert "Restored" not in out.stderr


def test_options_a_command_line_checks_first():
    """decode.check_options needs no model; a NaN temperature is refused like a negative one."""
    with pytest.raises(decode.OptionError, match="temperature must be > 0") as e:
        decode.check_options(method="sample", max_new_tokens=1, temperature=float("nan"))
    assert e.value.option == "temperature"


def _files(directory) -> dict:
    """Every file and folder under `directory`: path -> its bytes (None for a folder)."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), directory)] = None
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), directory)] = fh.read()
    return out


def test_decode_cli_passes_over_a_damaged_newest_step_and_changes_nothing(
    translate_run, data_dir, tmp_path
):
    """The newest step that verifies, as a resumed run takes it; the damaged one is named and
    left where it is (a decode moves and deletes nothing). Asked for by --step, it is an error."""
    workdir = str(tmp_path / "run")
    shutil.copytree(translate_run[1], workdir)
    damaged = os.path.join(workdir, "checkpoints", "4")
    with open(os.path.join(damaged, "params", "_METADATA"), "w") as f:
        f.write("{")
    before = _files(workdir)
    out = decode_cli(workdir, data_dir, "--input=17", "--max_new_tokens=4")
    assert out.returncode == 0 and out.stdout.startswith("17\t"), out.stderr
    assert f"Checkpoint unusable: {damaged}/params/_METADATA: not valid JSON" in out.stderr
    assert f"Decoding with checkpoint {workdir}/checkpoints/3, the newest that verifies" in (
        out.stderr
    )
    out = decode_cli(workdir, data_dir, "--input=17", "--step=4")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"decode.py: UnusableCheckpointError: {damaged}/params/_METADATA: not valid" in (
        out.stderr
    )
    assert _files(workdir) == before


def test_decode_cli_without_checkpoint_names_the_workdir(data_dir, tmp_path):
    out = decode_cli(str(tmp_path), data_dir, "--input=1")
    assert out.returncode != 0 and f"{str(tmp_path)!r} holds no checkpoint" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "source, where, byte",
    [
        ("file", "--input_file='{path}'", "byte 5 (line 2)"),
        ("stdin", "stdin", "byte 5 (line 2)"),
        ("flag", "--input #2", "byte 2 (line 1)"),
    ],
)
def test_decode_cli_input_that_is_not_utf8_names_it(
    translate_run, data_dir, tmp_path, source, where, byte
):
    text = b"17\n40\xff21\n"  # a Latin-1 byte at offset 5, on line 2
    path = tmp_path / "prompts.txt"
    path.write_bytes(text)
    args = {
        "file": [f"--input_file={path}"],
        "stdin": [],
        "flag": ["--input=17", b"--input=40\xff21"],
    }
    stdin = text if source == "stdin" else None
    out = decode_cli(translate_run[1], data_dir, *args[source], stdin=stdin)
    message = (
        f"{where.format(path=path)} is not UTF-8 text: {byte} is 0xff. Give the inputs as UTF-8"
    )
    assert_short_error(out, message)


def test_decode_cli_negative_max_new_tokens_names_the_flag(data_dir, tmp_path):
    for config in ("configs/translate.py:tiny", "configs/lm.py:tiny"):
        # No run in the workdir: the flag is refused before anything is loaded.
        out = decode_cli(tmp_path, data_dir, "--input=17", "--max_new_tokens=-1", config=config)
        assert_short_error(
            out,
            "--max_new_tokens=-1: give the number of tokens to generate per "
            "input (at least 1), or 0 for the default",
        )


def test_decode_cli_generates_within_the_models_max_len(lm_run, data_dir):
    """After the longest prompt the model's max_len (256) leaves room for so many tokens: a
    --max_new_tokens past it is refused by name, the default (32) is cut with a line; both
    were cut silently."""
    workdir = lm_run[1]
    lm = dict(config="configs/lm.py:tiny")
    out = decode_cli(workdir, data_dir, "--input=x", "--input=yz", "--max_new_tokens=300", **lm)
    assert_short_error(
        out,
        "decode.py: --max_new_tokens=300: --input #2 is 3 tokens long, and the model's "
        "max_len=256 leaves room for 253; give --max_new_tokens=253 or less, or a shorter input",
    )
    out = decode_cli(
        workdir, data_dir, "--input=" + "x" * 240, "--config.decode.max_new_tokens=0", **lm
    )
    assert out.returncode == 0 and out.stdout.startswith("x" * 240 + "\t"), out.stderr
    assert (
        "max_new_tokens=32 (the default): --input #1 is 241 tokens long, and the model's "
        "max_len=256 leaves room for 15; generating at most 15 per input"
    ) in out.stderr


def test_decode_cli_warns_of_sources_longer_than_trained(translate_run, data_dir, tmp_path):
    config, workdir = translate_run
    path = tmp_path / "sources.txt"
    path.write_text("17\n" + "1234567890" * 3 + "\n")  # bytes: 30 tokens + eos
    out = decode_cli(workdir, data_dir, f"--input_file={path}", "--max_new_tokens=4")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2
    trained = config.dataset.seq_len
    assert (
        f"line 2 of {path} is 31 tokens long, but the model was trained on at most {trained} "
        "(dataset.seq_len): its output for it is unreliable"
    ) in out.stderr
    assert "line 1 of" not in out.stderr


def _run_in_terminal(cmd, timeout=300) -> str:
    """Runs cmd with stdout and stderr on a pseudo-terminal of 120 columns (a user's terminal);
    returns everything it printed."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=timeout) == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


def test_decoding_a_file_shows_progress_and_logs_its_rate(translate_run, data_dir, tmp_path):
    _, workdir = translate_run
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"{n}\n" for n in range(1, 41)))
    args = (f"--input_file={prompts}", "--max_new_tokens=6")
    out = decode_cli(workdir, data_dir, *args)
    assert out.returncode == 0, out.stderr
    [line] = [x for x in out.stderr.splitlines() if "Decoded 40 inputs: " in x]
    assert "tokens in" in line and "tokens/s) generated" in line
    assert "input/s" not in out.stderr  # no bar where stderr is not a terminal
    shown = _run_in_terminal(
        [
            sys.executable,
            os.path.join(ROOT, "experiments/decode.py"),
            "--config=" + os.path.join(ROOT, "configs/translate.py:tiny"),
            f"--config.data_dir={data_dir}",
            f"--workdir={workdir}",
            *args,
        ]
    )
    assert "decoding: 100%" in shown and "40/40" in shown and "input/s]" in shown


CHATML = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_lm_samples_show_a_chat_prompt_whole(monkeypatch):
    """A chat row's sample prompt is the whole rendered prompt, special tokens as text, though
    an end-of-turn (an eos id) comes before the question; the output stops at the first eos."""
    import types

    import ml_collections
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tfjax.data import checkpoint_tokenizer as ct
    from tfjax.tasks import lm

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bpe = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))  # bytes, no merges
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    files = {"tokenizer.json": bpe.to_str(), "tokenizer_config.json": json.dumps(config)}
    tokenizer = ct.CheckpointTokenizer({k: v.encode() for k, v in files.items()})
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What do you bake?"},
        {"role": "assistant", "content": "sun bread"},
    ]
    row = ct.encode_row(tokenizer, {"messages": messages})
    batch = {"tokens": row["tokens"][None], "weights": row["weights"][None]}
    generated = np.concatenate([tokenizer.encode("sun bread"), [tokenizer.eos_id, 70, 71]])

    def generate(model, params, rows, **kwargs):  # what the model would answer
        return np.tile(generated, (len(rows), 1)).astype(np.int32), None

    monkeypatch.setattr(decode, "generate", generate)
    d = ml_collections.ConfigDict(
        dict(num_samples=1, prompt_length=128, max_new_tokens=8, method="greedy", beam_size=4)
    )
    d.update(alpha=None, temperature=1.0, top_k=0, top_p=1.0, layout="auto")
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    exp = types.SimpleNamespace(
        model=types.SimpleNamespace(max_len=256), mesh=mesh, rules=(), replicated=None
    )
    (sample,) = lm.SamplesEval(d, 0).decode(exp, tokenizer, None, batch, step=0, index=0)
    prompt = tokenizer.render_chat(messages[:2], add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert sample == {"prompt": prompt, "output": "sun bread"}
