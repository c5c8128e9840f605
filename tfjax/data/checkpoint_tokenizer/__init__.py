"""The tokenizer and chat template of a Hugging Face checkpoint (moving into modules)."""

from tfjax.data.checkpoint_tokenizer.tokenizer import (  # noqa: F401
    ADDED_TOKENS,
    CHAT_TEMPLATE_FILE,
    FILES,
    GENERATION_CONFIG,
    NAMED_TOKENS,
    ROW_FORMATS,
    SENTENCEPIECE_MODEL,
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    CheckpointTokenizer,
    encode_row,
    message_weight,
    row_format,
)
