"""Checkpoint files: config.json, state dicts from safetensors or torch files, and writing
safetensors.

A `StateDict` maps each PyTorch key to a numpy array and remembers the file it came from, so the
checks in `rules.import_state` can name the file of any key they refuse. `read_state_dict(d,
lazy=True)` gives a `LazyStateDict` of safetensors files instead: keys and shapes from the
files' headers, each array read (memory-mapped) only when asked for, so a run can convert and
place a checkpoint tensor by tensor without holding it all. `load_source` gives
(state dict, config dict) from what every `from_*` accepts: a checkpoint directory, or a state
dict (torch tensors or numpy arrays) with its config (a dict, a transformers config or a path).
A file that cannot be read (truncated, not JSON, without the table it must hold) is a ValueError
naming it, what is wrong and what to do.
"""

import contextlib
import hashlib
import json
import os
import re

import numpy as np

from tfjax import jsonfile

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
CONFIG = "config.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX)


class ContentDigest:
    """The identity of a checkpoint's weights by their content: SHA-256 over each tensor's name,
    dtype, shape and bytes, in name order, of the tensors given to `add` (a state dict's reads:
    `read_state_dict(..., digest=)`). File names, headers and sizes are the same for two
    checkpoints of one architecture (another seed, a base and its instruct model); the bytes are
    not. Hashing runs at about 1.5 GB/s a core (SHA-NI), beside reading the same bytes."""

    def __init__(self):
        self._tensors: dict[str, bytes] = {}

    def add(self, key: str, array) -> None:
        if key in self._tensors:  # read again (a tied weight): the same bytes
            return
        array = np.ascontiguousarray(array)
        digest = hashlib.sha256(f"{key}:{array.dtype}:{array.shape}:".encode())
        digest.update(array.reshape(-1).view(np.uint8))
        self._tensors[key] = digest.digest()

    def __len__(self) -> int:
        return len(self._tensors)

    def hexdigest(self) -> str:
        digest = hashlib.sha256()
        for key in sorted(self._tensors):
            digest.update(key.encode() + b"\0" + self._tensors[key])
        return digest.hexdigest()[:32]


class StateDict(dict):
    """name -> numpy array, remembering which file each name came from (for error messages)."""

    def __init__(self, arrays=(), files=None, origin="<state dict>"):
        super().__init__(arrays)
        self.files = dict(files or {})
        self.origin = origin

    def where(self, key: str) -> str:
        return self.files.get(key, self.origin)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self[key].shape)


class LazyStateDict(StateDict):
    """A StateDict of safetensors files whose arrays are read when indexed, one at a time (its
    values are read from disk on each access; nothing is cached). `shape` reads the header."""

    def __init__(self, files: dict[str, str], origin: str, digest: ContentDigest | None = None):
        self._open = {path: _open_safetensors(path) for path in set(files.values())}
        self._digest = digest
        super().__init__(dict.fromkeys(files), files, origin)

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self:
            raise KeyError(key)
        path = self.files[key]
        with _damaged(path):
            array = self._open[path].get_tensor(key)
        if self._digest is not None:
            self._digest.add(key, array)
        return array

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open[self.files[key]].get_slice(key).get_shape())

    def __iter__(self):  # (also makes dict(lazy) and StateDict(lazy) read through __getitem__)
        return iter(self.files)

    def values(self):
        return (self[k] for k in self)

    def items(self):
        return ((k, self[k]) for k in self)

    def get(self, key, default=None):
        return self[key] if key in self else default


def as_state_dict(state, origin="<state dict>") -> StateDict:
    """A StateDict of numpy arrays from torch tensors, numpy arrays or a StateDict."""
    if isinstance(state, StateDict):
        return state
    if not isinstance(state, dict):
        raise ValueError(f"expected a state dict (name -> tensor), got {type(state).__name__}")
    return StateDict({k: _to_numpy(v) for k, v in state.items()}, origin=origin)


def _to_numpy(x):
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        import torch  # noqa: PLC0415 (torch is optional)

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            import ml_dtypes  # noqa: PLC0415

            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def _one_line(error: BaseException, prefer=()) -> str:
    """The error's type and first sentence (of its first line starting with one of `prefer`)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    line = next((x for x in lines if x.startswith(tuple(prefer))), lines[0])
    return f"{type(error).__name__}: {line.split('. ')[0]}"


@contextlib.contextmanager
def _damaged(path: str):
    """A safetensors file the library cannot read, as one line naming it and what to do."""
    from safetensors import SafetensorError  # noqa: PLC0415 (an optional dependency)

    try:
        yield
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"{path} cannot be read as safetensors ({_one_line(e)}): the file is truncated or "
            "damaged; download or write it again"
        ) from None


def _open_safetensors(path):
    from safetensors import safe_open  # noqa: PLC0415

    with _damaged(path):
        return safe_open(path, framework="numpy")


def _read_safetensors(path):
    from safetensors.numpy import load_file  # noqa: PLC0415

    with _damaged(path):
        return load_file(path)


def _safetensors_keys(directory, shards) -> dict[str, str]:
    """key -> the shard file holding it, from the files' headers (no tensor is read)."""
    files = {}
    for shard in shards:
        path = os.path.join(directory, shard)
        with _open_safetensors(path) as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def _read_torch(path):
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(f"reading {path} needs torch; or convert it to safetensors") from e
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for a bad file
        other = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if other:
            raise ValueError(
                f"{path} holds objects other than tensors ({other.group(1)}), which tfjax does "
                "not unpickle (torch.load's weights_only=True: unpickling runs code); convert it "
                "to safetensors where it was made"
            ) from None
        raise ValueError(
            f"{path} cannot be read by torch.load ({_one_line(e, ['Unsupported'])}): the file "
            "is truncated, damaged or not written by torch.save; download or write it again"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path} holds a {type(state).__name__}, not a state dict (tensor name -> tensor)"
        )
    return {k: _to_numpy(v) for k, v in state.items()}


def _shards(path: str) -> list[str]:
    """The shard files a sharded checkpoint's index lists (its weight_map's values)."""
    index = jsonfile.read_object(path, "a sharded checkpoint's index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        found = "none" if weight_map is None else f"a {type(weight_map).__name__}"
        raise ValueError(
            f"{path} has no weight_map of tensor name -> shard file (found {found}); the index "
            "is damaged: download or write it again"
        )
    return sorted(set(weight_map.values()))


def read_state_dict(
    directory, *, lazy: bool = False, digest: ContentDigest | None = None
) -> StateDict:
    """All weights in a local checkpoint directory (safetensors first, then torch files).

    Reads model.safetensors, a sharded model.safetensors.index.json, pytorch_model.bin or its
    index. Raises FileNotFoundError naming the directory and the files looked for. `lazy`: a
    LazyStateDict for safetensors (torch files are read whole: torch.load has no lazy read).
    `digest`: given every tensor as it is read (a lazy one's as they are asked for).
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    for name, reader in (
        (SAFETENSORS, _read_safetensors),
        (SAFETENSORS_INDEX, _read_safetensors),
        (TORCH_BIN, _read_torch),
        (TORCH_BIN_INDEX, _read_torch),
    ):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        shards = _shards(path) if name.endswith(".index.json") else [name]
        for shard in shards:
            if not os.path.isfile(os.path.join(directory, shard)):
                raise FileNotFoundError(f"{path} lists the shard {shard!r}, which is missing")
        if lazy and reader is _read_safetensors:
            return LazyStateDict(_safetensors_keys(directory, shards), origin=path, digest=digest)
        state = StateDict(origin=path)
        for shard in shards:
            shard_path = os.path.join(directory, shard)
            for key, value in reader(shard_path).items():
                state[key] = value
                state.files[key] = shard_path
                if digest is not None:
                    digest.add(key, value)
        return state
    raise FileNotFoundError(
        f"no weights in {directory!r}: looked for {', '.join(WEIGHT_FILES)}; "
        f"found {listing(os.listdir(directory)) or 'nothing'}"
    )


def read_config(directory) -> dict:
    """The Hugging Face config.json of a checkpoint directory, as a dict."""
    path = os.path.join(os.fspath(directory), CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {CONFIG} in {os.fspath(directory)!r}")
    return jsonfile.read_object(path, "a checkpoint's config.json")


def as_config(config) -> dict:
    """A config dict from a dict, a transformers PretrainedConfig or a directory."""
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, str | os.PathLike):
        return read_config(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise ValueError(f"config must be a dict, a PretrainedConfig or a path, got {type(config)}")


def load_source(source, config=None) -> tuple[StateDict, dict]:
    """(state dict, config dict) from a checkpoint directory, or a state dict and its config."""
    if isinstance(source, dict):
        if config is None:
            raise ValueError("a state dict needs its config (a dict or a transformers config)")
        return as_state_dict(source), as_config(config)
    state = read_state_dict(source)
    return state, as_config(source if config is None else config)


MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


def write_safetensors(
    state: dict, directory, config: dict | None = None, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> str:
    """Writes model.safetensors (and config.json) into directory; returns the weights' path.

    Weights above `max_shard_bytes` go into shards model-0000i-of-0000n.safetensors with the
    index model.safetensors.index.json (returned instead), as transformers writes them: keys in
    order, a new shard when the next tensor would overflow the current one.
    """
    from safetensors.numpy import save_file  # noqa: PLC0415

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    arrays = {k: np.ascontiguousarray(v) for k, v in state.items()}
    shards = [{}]
    for key, array in arrays.items():
        if (
            shards[-1]
            and sum(a.nbytes for a in shards[-1].values()) + array.nbytes > max_shard_bytes
        ):
            shards.append({})
        shards[-1][key] = array
    if len(shards) == 1:
        path = os.path.join(directory, SAFETENSORS)
        save_file(arrays, path, {"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(directory, name), {"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        path = os.path.join(directory, SAFETENSORS_INDEX)
        total = sum(a.nbytes for a in arrays.values())
        with open(path, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if config is not None:
        with open(os.path.join(directory, CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return path


def listing(names, limit=8) -> str:
    """Sorted names for a message, the first `limit` of them and how many more."""
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more
