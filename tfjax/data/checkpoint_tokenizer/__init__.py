"""The tokenizer and chat template of a Hugging Face checkpoint, and training examples from rows.

    tok = CheckpointTokenizer.load("/path/to/Qwen2.5-0.5B-Instruct")   # a local directory
    tok.encode("Hello") -> int32 [n]          # no special tokens added
    tok.decode(ids) -> str                    # up to the first stop id, control tokens dropped
    tok.decode(ids, whole=True) -> str        # a prompt: every id, special tokens as text
    tok.render_chat(messages, add_generation_prompt=True) -> str   # the checkpoint's template
    tok.encode_chat(messages, add_generation_prompt=True) -> int32 [n]  # a prompt to generate from
    tok.save(workdir)                         # the files it was loaded from, byte for byte

Neither transformers nor torch is imported. Files read from the directory:

  tokenizer.json          through the `tokenizers` library (preferred when both are there)
  tokenizer.model         else through `sentencepiece`
  tokenizer_config.json   bos/eos/pad/unk/... tokens (strings or {"content": ...}),
                          added_tokens_decoder, chat_template (a string, or a list of named
                          templates: "default" is used), add_bos_token and legacy (SentencePiece)
  chat_template.jinja     the template as newer transformers save it; wins over the config's
  special_tokens_map.json the named tokens tokenizer_config.json leaves out
  added_tokens.json       older SentencePiece checkpoints' added tokens {"token": id}
  generation_config.json  eos_token_id (an int or a list: all of them stop generation),
                          bos_token_id and pad_token_id where the tokenizer names none

A damaged file (empty, cut short, not JSON, JSON of something else, a Git LFS pointer, bytes
SentencePiece cannot parse) is a ValueError of one line naming it and what to do.

Ids: `bos_id`, `pad_id` are None where the checkpoint has none (never assumed to be 0);
`eos_id` is the tokenizer's eos (else generation_config's first); `eos_ids` are every id
generation stops at, `eos_id` first. `vocab_size` is max id + 1 over the base vocabulary and
the added tokens (the model's embedding may be larger: ids past it are never produced).
`add_bos` says whether a document starts with bos, as the checkpoint does it: for
tokenizer.json, whether its post-processor adds bos (Llama 3, Gemma: yes; Qwen: no; the
config's add_bos_token is ignored there, as transformers does); for tokenizer.model, the
config's add_bos_token (default True, the SentencePiece tokenizers' default).

Encoding follows the `tokenizers` library on tokenizer.json exactly (transformers does the same
for PreTrainedTokenizerFast checkpoints; a few transformers 5 classes such as LlamaTokenizer
rebuild their pipeline instead). For tokenizer.model the text is split at the added tokens and
each piece encoded by SentencePiece, with its dummy prefix on every piece, or, where the config
says "legacy": false, only on the text's first (transformers' two modes). Unlike transformers'
conversion, text that starts with a space keeps SentencePiece's own "▁▁" (the original
tokenizer's ids). Decoding never applies clean_up_tokenization_spaces.

Chat templates render as transformers renders them: jinja2's immutable sandbox with trim_blocks
and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, transformers' `tojson`
(non-ASCII kept; indent, separators, sort_keys), a guarded `dict` and `namespace`, the
`{% generation %}` tag (rendered as its body), and the variables `messages`,
`add_generation_prompt`, `tools`, `documents` (None) and every named special token
(`bos_token`, `eos_token`, ...; bos, eos and pad must be in the vocabulary, the others may be
only text). Message keys whose value is None are dropped first. A template that fails
(raise_exception, a bug, a conversation it refuses) is a ValueError.

Rows -> training examples (the file reader calls these two):

  row_format(row) -> "text" | "prompt_completion" | "messages"
      {"messages": [...]} wins over the others (datasets often carry a "prompt" column too);
      then "completion" or "prompt" (without "text") means prompt_completion; then "text".
      Other keys are ignored. A row with none of them: ValueError.
  encode_row(tokenizer, row) -> {"tokens": int32 [L], "weights": float32 [L]}
      weights[t] is 1.0 where token t is a target of the loss (predicted from position t-1).
      text               [bos if add_bos] + encode(text) + [eos]; weight 1 after the first token.
      prompt_completion  [bos if add_bos] + encode(prompt) + encode(completion) + [eos]; weight 1
                         on the completion's tokens and the eos. The two are encoded apart, so
                         the boundary is exact, and plain: the chat template is never applied
                         (use "messages" for a chat).
      messages           the whole conversation rendered by the chat template and encoded
                         (transformers' apply_chat_template ids; bos prepended only where
                         add_bos and the template did not print bos first itself, so never
                         doubled); weight 1 on each assistant turn: its content and the
                         end-of-turn token(s) the template writes right after it (<|im_end|>,
                         <|eot_id|>, <end_of_turn>, </s>) so the model learns to stop; 0 on the
                         system, user and tool turns, on the assistant headers and on the
                         template's layout whitespace around a turn. A turn is found by
                         rendering messages[:i] with the generation prompt and messages[:i+1]:
                         the first must be a prefix of the second (up to trailing whitespace)
                         and the second a prefix of the whole rendering, or the row is refused
                         (a template that renders earlier turns differently cannot be split this
                         way: Qwen3's writes a think block only in the turns after the last user
                         message; such conversations need one row per assistant turn).
                         Offsets map the characters to tokens: the `tokenizers` library's for
                         tokenizer.json, SentencePiece's offset mapping for tokenizer.model.
                         An assistant message's "weight" (OpenAI's chat fine-tuning format,
                         also honoured by axolotl; TRL's SFTTrainer ignores it) is 1, trained
                         (as without it or null), or 0: that turn is rendered but weighted 0
                         like a user turn. Any other value, or a weight on a message of another
                         role, is refused (`message_weight`). A row whose every assistant turn
                         has weight 0 trains nothing: all its weights are 0.
  A row missing a field, a message without "role" or "content", content that is not a string,
  a "weight" that is not 0 or 1 on an assistant message, or a conversation without an assistant
  turn: ValueError naming it (the caller adds the file and line).

Modules: tokenizer (`CheckpointTokenizer`: loading, ids, encode/decode, chat rendering),
tokenizer_json and sentencepiece_model (its two backends), config_files (the files' names and
what the config files say: added tokens, named special tokens, generation ids), chat_template
(jinja2 as transformers renders it), rows (`row_format`, `encode_row`: rows -> examples).
"""

from tfjax.data.checkpoint_tokenizer.rows import (
    ROW_FORMATS,
    encode_row,
    message_weight,
    row_format,
)
from tfjax.data.checkpoint_tokenizer.tokenizer import CheckpointTokenizer

__all__ = [
    "ROW_FORMATS",
    "CheckpointTokenizer",
    "encode_row",
    "message_weight",
    "row_format",
]
