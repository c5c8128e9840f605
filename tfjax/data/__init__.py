"""How every experiment gets its batches: TFDS data sources (or the user's own files) -> Grain
loaders.

    import tfjax.data
    spec = tfjax.data.resolve_config({"name": "digits"})   # a DatasetSpec; tfjax.data.catalog
    tfjax.data.prepare("digits")                              # once; offline; reused after
    loader = tfjax.data.make_loader(spec, split="train", batch_size=64, seed=0, shuffle=True,
                                    num_epochs=None)
    batch = next(loader); state = loader.get_state()          # ... later: loader.set_state(state)

Batches are dicts of numpy arrays whose shapes never change (the last partial batch is padded
with zero rows). Padding is token id 0 and weight 0; with tfjax's tokenizers id 0 is only
padding (tfjax.data.tokenizers), with a checkpoint's (the "files" dataset) it may be a real
token, so what is padding is told by "weights" and the segment ids, never by the id. Per task
(the `tfjax.tasks` names; a dataset lists the tasks it serves in its catalog entry):

  classification        images: image f32 [B, H, W, C] in [-1, 1], label i32 [B], weights f32 [B]
                        text: tokens i32 [B, T] (bos ... eos), label i32 [B], weights f32 [B]
  lm                    tokens i32 [B, T] (bos ... eos per example; the loss shifts),
                        weights f32 [B, T] (1.0 on the tokens the loss trains: every real
                        token of TFDS text, the completion and eos of a prompt/completion row,
                        the assistant turns of a chat; 0.0 on padding and untrained tokens)
  mlm                   tokens i32 [B, T] (corrupted), targets i32 [B, T] (original),
                        weights f32 [B, T] (1.0 where picked for prediction)
  translation           inputs i32 [B, T], targets i32 [B, T] (each ends with eos; the model
                        shifts targets right itself)

Classification `weights` is 0.0 on the padding rows of a last partial batch. With a finite
`num_epochs`, `loader.num_batches` is the same on every process (shorter shards end with
all-padding batches), so multi-host evaluation stays in step (None when packing or splitting
makes the count unknowable ahead).

With `packing`, each token key k also gets k_segment_ids i32 [B, T] (1..n per row, 0 on
padding) and k_positions i32 [B, T] (from 0 within each example): tokens_* for lm/mlm,
inputs_* and targets_* for translation.

Modules: catalog (dataset names, config fields, the resolved DatasetSpec; plain data), sources
(TFDS: prepare, read, train tokenizers), files (the user's .txt / JSON lines / Parquet / Arrow
files: config.dataset.train_files), loader (the Grain pipeline), preprocess (numpy
transforms), tokenizers, embedded (the offline TFDS builders), checkpoint_tokenizer (a Hugging
Face checkpoint's own tokenizer and chat template, and training examples from text,
prompt/completion and chat rows; its ids are the checkpoint's, not the shared scheme above).
Names below load their module on first use, so `from tfjax.data import catalog` (what configs
do) imports neither TFDS nor Grain; `import tfjax` and `tfjax.models` never import them.
"""

import importlib

# name -> the module of tfjax.data that defines it, imported when the name is first used.
_EXPORTS = {
    **dict.fromkeys(
        (
            "CATALOG",
            "DatasetSpec",
            "dataset_spec",
            "default_data_dir",
            "default_dataset_config",
            "element_spec",
            "is_embedded",
            "is_files",
            "resolve_config",
            "tokenizer_path",
            "with_placeholders",
        ),
        "catalog",
    ),
    **dict.fromkeys(("get_tokenizer", "open_source", "prepare"), "sources"),
    **dict.fromkeys(("Loader", "make_loader"), "loader"),
    **dict.fromkeys(
        (
            "BOS_ID",
            "EOS_ID",
            "MASK_ID",
            "PAD_ID",
            "UNK_ID",
            "ByteTokenizer",
            "SentencePieceTokenizer",
        ),
        "tokenizers",
    ),
    **dict.fromkeys(("CheckpointTokenizer", "encode_row", "row_format"), "checkpoint_tokenizer"),
}
_SUBMODULES = (
    "catalog",
    "checkpoint_tokenizer",
    "embedded",
    "files",
    "loader",
    "preprocess",
    "sources",
    "tokenizers",
)

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
