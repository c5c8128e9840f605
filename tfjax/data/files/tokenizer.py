"""The checkpoint tokenizer that the files' rows are encoded with: which config field names its
directory, loading it with errors naming that field, and its fingerprint for a loader's saved
position."""

from __future__ import annotations

import hashlib

from etils import epath

from tfjax.data.files.file_lists import is_local

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # a checkpoint's, one of them at least
TOKENIZER_FIELD = "dataset.tokenizer"  # the field naming their directory, unless init_from does


def _check_tokenizer_dir(directory: str, field: str) -> epath.Path:
    path = epath.Path(directory).expanduser() if is_local(directory) else epath.Path(directory)
    if field == TOKENIZER_FIELD:
        where, fix = f"{field}={directory!r}", ""
    else:  # the checkpoint's own: the user set no dataset.tokenizer
        where = f"{directory} (the checkpoint of {field}: dataset.tokenizer is unset)"
        fix = "; give the directory of its tokenizer files as dataset.tokenizer"
    if not path.is_dir():
        raise FileNotFoundError(
            f"{where} is not a directory; give the directory of the checkpoint's tokenizer "
            f"files ({' or '.join(TOKENIZER_FILES)}){fix and ' as dataset.tokenizer'}"
        )
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{where} holds no tokenizer file; expected "
            f"{' or '.join(TOKENIZER_FILES)} (the files of a Hugging Face checkpoint){fix}"
        )
    return path


def tokenizer_field(config) -> str:
    """Which field of a run's config gives the "files" dataset's tokenizer directory:
    dataset.tokenizer where set, else config.init_from (the checkpoint's own tokenizer:
    `tfjax.runner.pretrained.dataset_spec`): what `check` and `load_tokenizer` name."""
    from tfjax.data import catalog

    return TOKENIZER_FIELD if catalog.dataset_spec(config).tokenizer else "config.init_from"


def load_tokenizer(directory: str, field: str = TOKENIZER_FIELD):
    """`CheckpointTokenizer.load(directory)`, after checking that the directory holds a
    tokenizer file. `field` is the config field that gave the directory: errors name
    dataset.tokenizer and its value, or, for "config.init_from" (dataset.tokenizer unset: the
    checkpoint's own tokenizer), the checkpoint's file at fault and config.init_from, not a
    field the user never set."""
    from tfjax.data.checkpoint_tokenizer import CheckpointTokenizer

    path = _check_tokenizer_dir(directory, field)
    try:
        return CheckpointTokenizer.load(str(path))
    except Exception as e:  # noqa: BLE001 - any failure to read it: name the field
        if field == TOKENIZER_FIELD:
            raise ValueError(
                f"{field}={directory!r}: its tokenizer cannot be loaded ({type(e).__name__}: {e})"
            ) from e
        why = str(e).rstrip(".") if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        if str(path) not in why:  # (the tokenizer's own errors name the file)
            why = f"{path}: {why}"
        raise ValueError(f"{why} (the tokenizer of {field}: dataset.tokenizer is unset)") from e


def tokenizer_fingerprint(tokenizer) -> str:
    """A short name of a checkpoint tokenizer's files (their names and bytes), for a loader's
    saved position: the same tokenizer wherever it is read from."""
    digest = hashlib.sha256()
    for name, data in sorted(tokenizer.files.items()):
        digest.update(name.encode() + b"\0" + data)
    return f"sha256 {digest.hexdigest()[:16]}"
