"""How every experiment gets its batches: TFDS data sources -> Grain loaders.

    import tfjax.data
    cfg = tfjax.data.default_dataset_config("digits")       # fields: tfjax.data.catalog
    tfjax.data.prepare("digits")                              # once; offline; reused after
    loader = tfjax.data.make_loader(cfg, split="train", batch_size=64, seed=0, shuffle=True,
                                    num_epochs=None)
    batch = next(loader); state = loader.get_state()          # ... later: loader.set_state(state)

Batches are dicts of numpy arrays whose shapes never change (the last partial batch is padded
with zero rows). Token id 0 is padding everywhere (ids: tfjax.data.tokenizers). Per task:

  image_classification  image f32 [B, H, W, C] in [-1, 1], label i32 [B], weights f32 [B]
  text_classification   tokens i32 [B, T] (bos ... eos), label i32 [B], weights f32 [B]
  lm                    tokens i32 [B, T] (bos ... eos per example; the loss shifts)
  mlm                   tokens i32 [B, T] (corrupted), targets i32 [B, T] (original),
                        weights f32 [B, T] (1.0 where picked for prediction)
  translation           inputs i32 [B, T], targets i32 [B, T] (each ends with eos; the model
                        shifts targets right itself)

Classification `weights` is 0.0 on the padding rows of a last partial batch (text tasks mark
padding by token 0). With a finite `num_epochs`, `loader.num_batches` is the same on every
process (shorter shards end with all-padding batches), so multi-host evaluation stays in step
(None when packing or splitting makes the count unknowable ahead).

With `packing`, each token key k also gets k_segment_ids i32 [B, T] (1..n per row, 0 on
padding) and k_positions i32 [B, T] (from 0 within each example): tokens_* for lm/mlm,
inputs_* and targets_* for translation.

Modules: catalog (dataset names, config fields, sources, tokenizer files), loader (the Grain
pipeline), preprocess (numpy transforms), tokenizers, embedded (the offline TFDS builders).
TFDS and Grain are imported here only; `import tfjax` and `tfjax.models` never import them.
"""

from tfjax.data.catalog import (
    CATALOG,
    default_data_dir,
    default_dataset_config,
    get_tokenizer,
    open_source,
    prepare,
    resolve_config,
    tokenizer_path,
    with_placeholders,
)
from tfjax.data.loader import Loader, element_spec, make_loader
from tfjax.data.tokenizers import (
    BOS_ID,
    EOS_ID,
    MASK_ID,
    PAD_ID,
    UNK_ID,
    ByteTokenizer,
    SentencePieceTokenizer,
)

__all__ = [
    "BOS_ID",
    "CATALOG",
    "EOS_ID",
    "MASK_ID",
    "PAD_ID",
    "UNK_ID",
    "ByteTokenizer",
    "Loader",
    "SentencePieceTokenizer",
    "default_data_dir",
    "default_dataset_config",
    "element_spec",
    "get_tokenizer",
    "make_loader",
    "open_source",
    "prepare",
    "resolve_config",
    "with_placeholders",
    "tokenizer_path",
]
