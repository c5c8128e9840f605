"""CheckpointTokenizer against transformers, on small real Hugging Face tokenizer directories.

The directories are built once per module, offline, in well under a second: byte-level BPEs
like Qwen 2.5 (ChatML) and Llama 3 (a template that prints bos itself) and a byte-fallback BPE
like Gemma, each saved by transformers' save_pretrained, and a SentencePiece tokenizer.model like
Llama 2's with a hand-written tokenizer_config.json, "legacy" true and false. The reference is
transformers' own tokenizer of each directory.
"""

import io
import json
import pathlib
import pickle
import re
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
spm = pytest.importorskip("sentencepiece")

import tfjax.data as td  # noqa: E402
from tfjax.data import checkpoint_tokenizer as ct  # noqa: E402

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? It is 42! Numbers: 12345, 67890, 3.14159.",
    "Et en français ? Quarante-deux, naïvement. Café, crème brûlée.",
    "Ünïcödé: 東京, 数字, emoji 🙂 and ✓ marks.",
    "You are a helpful assistant. You are terse.",
    "  leading spaces,\ttabs and\nnew lines\n\n",
    "[INST] What is up? [/INST] Not much, and you?",
] * 5

TEXTS = [
    "Hello world!",
    "!",
    "!!! ?! x!",
    "  two  spaces,\ttabs\tand\n\nnew lines\n",
    "naïve café — 数字 ✓ 🙂",
    "12345 + 67890 = 80235",
    "",
    "ÅÉÎ 東京 x",
    "a control token <|im_end|> and <end_of_turn> written in text",
]

# A Qwen 2.5-like ChatML template: a default system prompt, tools as JSON, loop controls, and
# transformers' {% generation %} marks around what the assistant writes.
QWEN_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.' }}
{%- endif %}
{%- if tools %}
    {{- '\\n# Tools\\n' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# A Llama 3.1-like template: prints bos itself, today's date, trimmed contents.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Gemma's template (bos printed, roles checked with raise_exception, assistant -> model).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

# Llama 2's template (bos before every [INST], no generation prompt of its own).
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = '' %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if loop.index0 == 0 %}{% set content = system_message + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "42!"},
    {"role": "user", "content": "Et en français ? 🙂"},
    {"role": "assistant", "content": "Quarante-deux, naïvement.  "},
]
CHAT_NO_SYSTEM = CHAT[1:]

# What each template trains on: per assistant turn, its content and end-of-turn token(s).
EXPECTED_TURNS = {
    "qwen": ["42!<|im_end|>", "Quarante-deux, naïvement.  <|im_end|>"],
    "llama3": ["42!<|eot_id|>", "Quarante-deux, naïvement.<|eot_id|>"],
    "gemma": ["42!<end_of_turn>", "Quarante-deux, naïvement.<end_of_turn>"],
    "sentencepiece": ["42! </s>", "Quarante-deux, naïvement. </s>"],
}


def _byte_level_bpe():
    """A small byte-level BPE, GPT-2 style: the 256 byte symbols first, so "!" is id 0."""
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _special(*names):
    return [tokenizers.AddedToken(n, special=True, normalized=False) for n in names]


def _save(tok, directory, generation_config, **kwargs):
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    hf.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(generation_config))


def _qwen(directory, base):
    tok = tokenizers.Tokenizer.from_str(base.to_str())
    tok.add_special_tokens(_special("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    tok.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False)])
    tok.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    generation = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext]}
    generation["pad_token_id"] = endoftext
    _save(
        tok,
        directory,
        generation,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN_TEMPLATE,
    )


def _llama3(directory, base):
    tok = tokenizers.Tokenizer.from_str(base.to_str())
    names = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>")
    tok.add_special_tokens(_special(*names, "<|eot_id|>"))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = tokenizers.processors.Sequence(
        [
            tokenizers.processors.ByteLevel(trim_offsets=False),
            tokenizers.processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    eos = [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    _save(
        tok,
        directory,
        {"bos_token_id": bos, "eos_token_id": eos},
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        chat_template=LLAMA3_TEMPLATE,
    )


def _gemma(directory):
    """Gemma's kind: "▁" for spaces, BPE with byte fallback, specials at the start."""
    trainer_tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    trainer_tok.normalizer = tokenizers.normalizers.Replace(" ", "▁")
    trainer_tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split("\n", behavior="isolated"),
            tokenizers.pre_tokenizers.Split("▁", behavior="merged_with_next"),
        ]
    )
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, show_progress=False)
    trainer_tok.train_from_iterator(CORPUS[:6], trainer)  # no "[INST]": some byte fallback
    model = json.loads(trainer_tok.to_str())["model"]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    pieces += sorted(model["vocab"], key=model["vocab"].get)
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = trainer_tok.normalizer
    tok.pre_tokenizer = trainer_tok.pre_tokenizer
    tok.decoder = tokenizers.decoders.Sequence(
        [
            tokenizers.decoders.Replace("▁", " "),
            tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse(),
        ]
    )
    tok.add_special_tokens(_special(*specials))
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B:1", special_tokens=[("<bos>", 2)]
    )
    _save(
        tok,
        directory,
        {"bos_token_id": 2, "eos_token_id": [1, 5], "pad_token_id": 0},
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=GEMMA_TEMPLATE,
    )


def _sentencepiece(directory, *, legacy):
    """Llama 2's kind: tokenizer.model (BPE, byte fallback) and a hand-written config."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        hard_vocab_limit=False,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    directory.mkdir()
    (directory / "tokenizer.model").write_bytes(model.getvalue())

    def added(content):
        flags = dict.fromkeys(("lstrip", "rstrip", "single_word", "normalized"), False)
        return {"content": content, "special": True, **flags}

    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": {"__type": "AddedToken", "content": "<unk>", "lstrip": False, "rstrip": False},
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": legacy,
        "added_tokens_decoder": {"0": added("<unk>"), "1": added("<s>"), "2": added("</s>")},
        "chat_template": LLAMA2_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, transformers' tokenizer of it, CheckpointTokenizer of it)."""
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("checkpoints")
    base = _byte_level_bpe()
    _qwen(root / "qwen", base)
    _llama3(root / "llama3", base)
    _gemma(root / "gemma")
    _sentencepiece(root / "sentencepiece", legacy=True)
    _sentencepiece(root / "sentencepiece_nonlegacy", legacy=False)
    out = {}
    for name in ("qwen", "llama3", "gemma", "sentencepiece", "sentencepiece_nonlegacy"):
        out[name] = (root / name, _reference(root / name), ct.CheckpointTokenizer.load(root / name))
    return out


def _reference(directory):
    """transformers' tokenizer of a directory: the tokenizer_class its config names, the class
    AutoTokenizer.from_pretrained picks (whose module imports torch: ~10 s here)."""
    name = json.loads((directory / "tokenizer_config.json").read_text())["tokenizer_class"]
    return getattr(transformers, name).from_pretrained(directory)


BYTE_LEVEL = ("qwen", "llama3")
FAST = ("qwen", "llama3", "gemma")
ALL = ("qwen", "llama3", "gemma", "sentencepiece", "sentencepiece_nonlegacy")


def _chat(name):
    return CHAT_NO_SYSTEM if name == "gemma" else CHAT


@pytest.mark.parametrize("name", ALL)
def test_encode_decode_match_transformers(checkpoints, name):
    _, hf, tok = checkpoints[name]
    for text in TEXTS:
        if name.startswith("sentencepiece") and text[:1].isspace():
            # transformers' Metaspace does not add "▁" before a leading space; SentencePiece
            # (the tokenizer the checkpoint was trained with) does: checked below instead.
            continue
        expected = hf.encode(text, add_special_tokens=False)
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.tolist() == expected, text
        stop = next((k for k, i in enumerate(expected) if i in tok.eos_ids), len(expected))
        assert tok.decode(ids) == hf.decode(expected[:stop], skip_special_tokens=True), text
    if name in BYTE_LEVEL:  # every id, "!" (id 0) included, decodes as transformers does
        rng = np.random.default_rng(0)
        ids = [i for i in rng.integers(0, tok.vocab_size, 300).tolist() if i not in tok.eos_ids]
        assert tok.decode([0]) == "!" and tok.encode("!").tolist() == [0]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.vocab_size == max(hf.get_vocab().values()) + 1


def test_sentencepiece_is_sentencepiece(checkpoints):
    directory, _, tok = checkpoints["sentencepiece"]
    sp = spm.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
    for text in TEXTS:
        if "<" not in text:
            assert tok.encode(text).tolist() == sp.encode(text), text
            assert tok.decode(tok.encode(text)) == text
    # "legacy": false keeps the dummy prefix at the start of the text only.
    _, hf, nonlegacy = checkpoints["sentencepiece_nonlegacy"]
    text = "<s>[INST] hi [/INST] ok</s>"
    assert nonlegacy.encode(text).tolist() == hf.encode(text, add_special_tokens=False)
    assert nonlegacy.encode(text).tolist() != tok.encode(text).tolist()
    # added_tokens.json (older checkpoints): a token past the model's pieces
    files = dict(tok.files, **{"added_tokens.json": b'{"<tool>": 400}'})
    added = ct.CheckpointTokenizer(files, path="added")
    ids = added.encode("a<tool>b").tolist()
    assert 400 in ids and added.vocab_size == 401 and added.decode(ids) == "a<tool>b"


@pytest.mark.parametrize("name", ALL)
def test_special_ids_and_bos_follow_the_checkpoint(checkpoints, name):
    _, hf, tok = checkpoints[name]
    expected = {
        "qwen": (None, "<|im_end|>", "<|endoftext|>", False),
        "llama3": ("<|begin_of_text|>", "<|eot_id|>", None, True),
        "gemma": ("<bos>", "<eos>", "<pad>", True),
        "sentencepiece": ("<s>", "</s>", None, True),
        "sentencepiece_nonlegacy": ("<s>", "</s>", None, True),
    }[name]
    bos, eos, pad, add_bos = expected
    if name == "qwen":  # no bos token; generation_config's bos_token_id stands in
        assert tok.bos_id == hf.convert_tokens_to_ids("<|endoftext|>")
    else:
        assert tok.bos_id == hf.convert_tokens_to_ids(bos) == hf.bos_token_id
    assert tok.eos_id == hf.convert_tokens_to_ids(eos) == hf.eos_token_id
    assert tok.pad_id == (None if pad is None else hf.convert_tokens_to_ids(pad))
    assert tok.add_bos is add_bos
    # A document: transformers' encode with special tokens, then eos.
    row = ct.encode_row(tok, {"text": "Hello world!"})
    assert row["tokens"].tolist() == hf.encode("Hello world!") + [tok.eos_id]


def test_eos_ids_come_from_generation_config(checkpoints):
    _, hf, llama3 = checkpoints["llama3"]
    eot, end = hf.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert llama3.eos_ids == (eot, end) and llama3.eos_id == eot
    _, hf, qwen = checkpoints["qwen"]
    assert qwen.eos_ids == tuple(hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    assert checkpoints["gemma"][2].eos_ids == (1, 5)
    assert checkpoints["sentencepiece"][2].eos_ids == (2,)  # no generation_config.json
    # decode stops at any of them
    ids = llama3.encode("Hello world!").tolist()
    assert llama3.decode(ids + [end] + ids) == "Hello world!"


@pytest.mark.parametrize("name", ALL)
def test_decode_whole_shows_a_prompt_as_rendered(checkpoints, name):
    """A prompt is shown whole, its special tokens as text, end-of-turn tokens included (the
    samples' prompts); generated text stops at the first eos (tested above)."""
    _, _, tok = checkpoints[name]
    text = tok.render_chat(_chat(name), add_generation_prompt=True)
    ids = tok.encode_chat(_chat(name), add_generation_prompt=True)
    assert any(i in tok.eos_ids for i in ids[:-1])  # an end of turn before the last question
    assert tok.decode(ids, whole=True) == text


@pytest.mark.parametrize("name", ALL)
def test_render_chat_matches_transformers(checkpoints, name):
    _, hf, tok = checkpoints[name]
    chat = _chat(name)
    for prompt in (False, True):
        expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
        assert tok.render_chat(chat, add_generation_prompt=prompt) == expected
    if name == "qwen":  # tools through tojson, non-ASCII kept
        tools = [{"name": "météo", "parameters": {"ville": {"type": "string"}}}]
        expected = hf.apply_chat_template(chat, tools=tools, tokenize=False)
        assert tok.render_chat(chat, tools=tools) == expected and "météo" in expected


# What templates rely on besides the basics: namespace, dict, tojson's options, tests on
# undefined and None variables, the reasoning aliases, None-valued keys dropped, the date.
FEATURES_TEMPLATE = """{%- set ns = namespace(n=0) %}
{%- for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}
{{- ns.n }} {{ dict(b='é', a=[1, 2]) | tojson(indent=2, sort_keys=True) }}
{{ tools is none }} {{ bos_token is defined }} {{ pad_token }} {{ eos_token }}
{% for m in messages %}[{{ m.role }}|{{ m.name is defined }}|{{ m | tojson }}]
{%- if loop.last %}.{% endif %}{% endfor %}
{{ strftime_now('%Y') }}
"""


def test_template_features_match_transformers(checkpoints):
    _, hf, qwen = checkpoints["qwen"]
    chat = [
        {"role": "user", "content": "héllo", "name": None},
        {"role": "assistant", "content": "ok", "thinking": "hmm"},
    ]
    files = dict(qwen.files, **{"chat_template.jinja": FEATURES_TEMPLATE.encode()})
    tok = ct.CheckpointTokenizer(files, path="features")
    expected = hf.apply_chat_template(chat, chat_template=FEATURES_TEMPLATE, tokenize=False)
    assert tok.render_chat(chat) == expected and '"reasoning_content": "hmm"' in expected
    for template, message in [
        ("{{ ''.__class__.__mro__ }}", r"SecurityError"),
        ("{% set ns = namespace(_x=1) %}", r"underscore"),
        ("{{ raise_exception('no, thanks') }}", r"failed on this conversation: .*no, thanks"),
        ("{% if %}", r"does not compile"),
    ]:
        files["chat_template.jinja"] = template.encode()
        with pytest.raises(ValueError, match=message):
            ct.CheckpointTokenizer(files, path="bad").render_chat(chat)


@pytest.mark.parametrize("name", ALL)
def test_messages_example_trains_on_assistant_turns(checkpoints, name):
    _, hf, tok = checkpoints[name]
    chat = _chat(name)
    example = ct.encode_row(tok, {"messages": chat, "prompt": "ignored"})
    tokens, weights = example["tokens"], example["weights"]
    assert tokens.dtype == np.int32 and weights.dtype == np.float32
    expected = hf.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert tokens.tolist() == expected
    if tok.add_bos:  # the template printed bos: not doubled
        assert tokens[0] == tok.bos_id and tokens[1] != tok.bos_id
    # Weighted runs, as text: exactly each assistant turn's content and end-of-turn token.
    assert set(weights.tolist()) <= {0.0, 1.0}
    assert _weighted_runs(hf, example) == EXPECTED_TURNS[name.removesuffix("_nonlegacy")]
    if name == "qwen":  # its template marks the assistant's text: transformers' own mask agrees
        out = hf.apply_chat_template(
            chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert weights.tolist() == [float(m) for m in out["assistant_masks"]]
    # a prompt to generate from is the template's with the generation prompt
    prompt = hf.apply_chat_template(chat[:-1], add_generation_prompt=True, return_dict=False)
    assert tok.encode_chat(chat[:-1]).tolist() == prompt


@pytest.mark.parametrize("name", ("qwen", "sentencepiece"))
def test_an_assistant_turn_of_weight_0_is_not_trained(checkpoints, name):
    """OpenAI's chat fine-tuning format: "weight" 0 on an assistant message leaves its turn
    untrained, 1 trains it; the rendering (the tokens) is the same as without the key."""
    _, hf, tok = checkpoints[name]
    chat = _chat(name)
    turns = EXPECTED_TURNS[name]
    plain = ct.encode_row(tok, {"messages": chat})
    for first, last, trained in [(0, 1, turns[1:]), (1, 0, turns[:1]), (1, 1, turns)]:
        assistant = iter([first, last])
        weighted = [
            {**m, "weight": next(assistant)} if m["role"] == "assistant" else m for m in chat
        ]
        example = ct.encode_row(tok, {"messages": weighted})
        assert example["tokens"].tolist() == plain["tokens"].tolist()
        assert _weighted_runs(hf, example) == trained
    weighted = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in chat]
    example = ct.encode_row(tok, {"messages": weighted})  # trains nothing: all weights 0
    assert example["tokens"].tolist() == plain["tokens"].tolist()
    assert not example["weights"].any()


def _weighted_runs(hf, example):
    """The runs of weight-1 tokens of an example, as text."""
    runs, run = [], []
    pairs = zip(example["tokens"].tolist() + [-1], example["weights"].tolist() + [0.0], strict=True)
    for token, weight in pairs:
        if weight == 1.0:
            run.append(token)
        elif run:
            runs.append(hf.decode(run, skip_special_tokens=False))
            run = []
    return runs


# Written without {{- }}: it starts with a newline before bos, and its generation prompt ends
# with a newline more than an assistant turn has after its header.
LOOSE_TEMPLATE = """
{{ bos_token }}
{% for message in messages %}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{% endif %}
"""


def test_other_templates_on_a_checkpoint(checkpoints):
    _, hf, llama3 = checkpoints["llama3"]
    files = llama3.files
    for template, bos_added, turns in [
        (LOOSE_TEMPLATE, False, ["42!<|eot_id|>", "Quarante-deux, naïvement.<|eot_id|>"]),
        (QWEN_TEMPLATE, True, EXPECTED_TURNS["qwen"]),  # no bos printed: add_bos adds it
    ]:
        files["chat_template.jinja"] = template.encode()
        tok = ct.CheckpointTokenizer(files, path="other")
        example = ct.encode_row(tok, {"messages": CHAT})
        expected = hf.apply_chat_template(CHAT, chat_template=template, return_dict=False)
        assert example["tokens"].tolist() == [tok.bos_id] * bos_added + expected
        assert _weighted_runs(hf, example) == turns


@pytest.mark.parametrize("name", ("qwen", "sentencepiece"))
def test_text_and_prompt_completion_examples(checkpoints, name):
    _, _, tok = checkpoints[name]
    bos = [tok.bos_id] if tok.add_bos else []
    text = ct.encode_row(tok, {"text": "Hello world!", "id": 7})
    body = tok.encode("Hello world!").tolist()
    assert text["tokens"].tolist() == bos + body + [tok.eos_id]
    assert text["weights"].tolist() == [0.0] + [1.0] * (len(bos) + len(body))
    row = {"prompt": "What is 12 + 30?", "completion": " 42!"}
    example = ct.encode_row(tok, row)
    prompt, completion = tok.encode(row["prompt"]).tolist(), tok.encode(" 42!").tolist()
    assert example["tokens"].tolist() == bos + prompt + completion + [tok.eos_id]
    weights = [0.0] * (len(bos) + len(prompt)) + [1.0] * (len(completion) + 1)
    assert example["weights"].tolist() == weights


def test_row_format():
    assert ct.row_format({"text": "a"}) == "text"
    assert ct.row_format({"prompt": "a", "completion": "b"}) == "prompt_completion"
    assert ct.row_format({"prompt": "a"}) == "prompt_completion"  # then: no 'completion'
    assert ct.row_format({"prompt": "a", "text": "b"}) == "text"
    assert ct.row_format({"messages": [], "prompt": "a", "prompt_id": "x"}) == "messages"
    with pytest.raises(ValueError, match=r"needs 'text', 'prompt' and 'completion', or 'messages'"):
        ct.row_format({"body": "a"})


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "a"}, r"needs 'completion'"),
        ({"completion": "a"}, r"needs 'prompt'"),
        ({"text": None}, r"needs 'text'"),
        ({"text": 3}, r"'text' must be a string, got int"),
        ({"messages": "hi"}, r"'messages' must be a list"),
        ({"messages": []}, r"'messages' is empty"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\] has no 'content'"),
        ({"messages": [{"content": "a"}]}, r"messages\[0\] has no 'role'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
            r"messages\[0\]\['content'\] must be a string, got list",
        ),
        ({"messages": [{"role": "user", "content": "a"}]}, r"no 'assistant' turn"),
        (
            {"messages": [{"role": "assistant", "content": "a", "weight": 0.5}]},
            r"messages\[0\]: 'weight' must be 0 \(the assistant turn is not trained\) or 1 "
            r"\(trained\), got 0.5",
        ),
        (
            {"messages": [{"role": "assistant", "content": "a", "weight": True}]},
            r"messages\[0\]: 'weight' must be 0 .* got True",
        ),
        (
            {"messages": [{"role": "user", "content": "a", "weight": 1}, CHAT[2]]},
            r"messages\[0\]: 'weight' is allowed only on an assistant message .* role is 'user'",
        ),
    ],
)
def test_bad_rows_name_what_is_missing(checkpoints, row, message):
    with pytest.raises(ValueError, match=message):
        ct.encode_row(checkpoints["qwen"][2], row)


def test_template_refusals(checkpoints):
    tok = checkpoints["gemma"][2]
    with pytest.raises(ValueError, match=r"chat template .* failed .* System role not supported"):
        ct.encode_row(tok, {"messages": CHAT})
    # Templates that render earlier turns differently cannot be split into turns: one that
    # starts with the number of messages, and one that, like Qwen3's, writes a think block
    # only in the last assistant turn.
    files = dict(checkpoints["qwen"][2].files)
    files["chat_template.jinja"] = ("{{ messages | length }}\n" + QWEN_TEMPLATE).encode()
    counting = ct.CheckpointTokenizer(files, path="counting")
    with pytest.raises(ValueError, match=r"messages\[:2\] rendered with add_generation_prompt"):
        ct.encode_row(counting, {"messages": CHAT})
    last = "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    thinking = QWEN_TEMPLATE.replace("{%- generation %}", last + "{%- generation %}")
    assert thinking != QWEN_TEMPLATE
    files["chat_template.jinja"] = thinking.encode()
    thinking = ct.CheckpointTokenizer(files, path="thinking")
    assert ct.encode_row(thinking, {"messages": CHAT[:3]})["weights"].sum() > 0
    with pytest.raises(ValueError, match=r"renders messages\[:3\] differently inside the whole"):
        ct.encode_row(thinking, {"messages": CHAT})


def test_pickle_and_save_round_trip(checkpoints, tmp_path):
    for name in ("llama3", "sentencepiece_nonlegacy"):
        _, _, tok = checkpoints[name]
        again = pickle.loads(pickle.dumps(tok))
        assert repr(again) == repr(tok)
        assert again.render_chat(CHAT) == tok.render_chat(CHAT)
        for text in TEXTS:
            assert again.encode(text).tolist() == tok.encode(text).tolist()
        tok.save(tmp_path / name)
        loaded = ct.CheckpointTokenizer.load(tmp_path / name)
        assert loaded.files == tok.files and loaded.eos_ids == tok.eos_ids
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == sorted(tok.files)
    assert "add_bos=True" in repr(tok) and "tokenizer.model" in repr(tok)


def test_config_variants(checkpoints, tmp_path):
    source = checkpoints["qwen"][0]
    directory = tmp_path / "variant"
    shutil.copytree(source, directory)
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = ct.CheckpointTokenizer.load(directory)
    assert tok.chat_template is None and "chat_template=none" in repr(tok)
    with pytest.raises(ValueError, match=r"variant has no chat template"):
        ct.encode_row(tok, {"messages": CHAT})
    # A list of named templates: "default" is used.
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": QWEN_TEMPLATE},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = ct.CheckpointTokenizer.load(directory)
    assert tok.render_chat(CHAT) == checkpoints["qwen"][2].render_chat(CHAT)
    # No generation_config.json: only the tokenizer's eos; still no pad assumed for llama3.
    (directory / "generation_config.json").unlink()
    assert ct.CheckpointTokenizer.load(directory).eos_ids == (tok.eos_id,)


def test_errors_name_the_file(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"is not a directory"):
        ct.CheckpointTokenizer.load(tmp_path / "absent")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no tokenizer: looked for tokenizer.json .* and "):
        ct.CheckpointTokenizer.load(tmp_path)
    directory = tmp_path / "broken"
    shutil.copytree(checkpoints["llama3"][0], directory)
    (directory / "generation_config.json").write_text('{"eos_token_id": [1, ')
    with pytest.raises(ValueError, match=r"broken/generation_config.json is not valid JSON"):
        ct.CheckpointTokenizer.load(directory)


LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 9\n"


@pytest.mark.parametrize(
    "name, file, damage, message",
    [
        (
            "qwen",
            "tokenizer.json",
            lambda b: b[:700],
            r"is cut short: its JSON ends mid-way, after 700",
        ),
        (
            "qwen",
            "tokenizer.json",
            lambda b: b.rstrip()[:-2],
            r"is cut short: its JSON ends mid-way",
        ),
        ("qwen", "tokenizer.json", lambda b: b"\x00\x01PK", r"is not valid JSON \(Expecting value"),
        ("qwen", "tokenizer.json", lambda b: b"", r"is not a tokenizer: it is empty \(0 bytes\)"),
        (
            "qwen",
            "tokenizer.json",
            lambda b: LFS_POINTER,
            r"is not a tokenizer: it is a Git LFS pointer",
        ),
        (
            "qwen",
            "tokenizer.json",
            lambda b: b'{"hello": 1}',
            r"is JSON but not a tokenizer: it holds an object with keys \['hello'\]",
        ),
        (
            "qwen",
            "tokenizer.json",
            lambda b: b"[1, 2]",
            r"is JSON but not a tokenizer: it holds a JSON list",
        ),
        (
            "qwen",
            "tokenizer.json",
            lambda b: b'{"model": {"type": "Nonesuch"}}',
            r"cannot be read by the tokenizers library [0-9.]+ \(.*\): download it again, or",
        ),
        (
            "sentencepiece",
            "tokenizer.model",
            lambda b: b[: len(b) // 2],
            r"is not a SentencePiece model: its \d+ bytes do not parse as one \(cut short or",
        ),
        (
            "sentencepiece",
            "tokenizer.model",
            lambda b: b"",
            r"is not a SentencePiece model: it is empty",
        ),
        (
            "sentencepiece",
            "tokenizer.model",
            lambda b: LFS_POINTER,
            r"model: it is a Git LFS pointer",
        ),
        ("sentencepiece", "tokenizer.model", lambda b: b'{"model": {}}', r"\(they are JSON text\)"),
        (
            "qwen",
            "tokenizer_config.json",
            lambda b: b[:40],
            r"is not valid JSON \(.*\); tokenizer_config",
        ),
        (
            "qwen",
            "tokenizer_config.json",
            lambda b: b"[]",
            r"holds a JSON list; tokenizer_config.json is a",
        ),
        (
            "llama3",
            "chat_template.jinja",
            lambda b: b"\xff{{",
            r"is not UTF-8 text \(.*\): damaged;",
        ),
    ],
)
def test_a_damaged_file_is_one_line_naming_it(checkpoints, name, file, damage, message):
    """Each file of a checkpoint's tokenizer, damaged: one line naming the file, what is wrong
    and what to do (download it again)."""
    _, _, tok = checkpoints[name]
    files = dict(tok.files, **{file: damage(tok.files[file])})
    with pytest.raises(ValueError) as error:
        ct.CheckpointTokenizer(files, path="/ckpt")
    text = str(error.value)
    assert text.startswith(f"/ckpt/{file} ") and "\n" not in text, text
    assert re.search(message, text) and "again" in text, text


def test_exported_lazily():
    assert td.CheckpointTokenizer is ct.CheckpointTokenizer
    assert td.encode_row is ct.encode_row and td.row_format is ct.row_format
    assert td.checkpoint_tokenizer is ct
    # the package, whose modules hold the names it exports
    assert pathlib.Path(ct.__file__).parent.name == "checkpoint_tokenizer"
    assert ct.CheckpointTokenizer.__module__ == "tfjax.data.checkpoint_tokenizer.tokenizer"
    assert ct.encode_row.__module__ == "tfjax.data.checkpoint_tokenizer.rows"
