"""LoraConfig, its constants, and QLoRA's checks on a base's quantization."""

from __future__ import annotations

import dataclasses
import math
import re

import flax
import flax.linen as nn

# The attention projections (self- and cross-attention: query, key, value, output; latent
# attention's query_down, query_up, kv_down, key_up, value_up, tfjax.ops.mla; a gated
# attention's gate; Gated DeltaNet's gate, beta and dt, tfjax.ops.linear_attention) and the MLP
# kernels (wi, or wi_0 and wi_1 when gated; wo) of tfjax's blocks, unrolled or scanned, a
# mixture's shared experts' among them (mlp/shared: a dense MLP every token passes). Not the
# embeddings, the output head, the norms, Gated DeltaNet's convolutions (*_conv: no matmul), nor
# a mixture's router or routed experts (mlp/router/kernel; mlp/experts/wi_0, which cannot be
# adapted).
DEFAULT_TARGETS = (
    r".*/(self_attention|cross_attention)/"
    r"(query|key|value|out|gate|beta|dt|query_down|query_up|kv_down|key_up|value_up)_kernel"
    r"|.*/mlp/(shared/)?(wi|wi_0|wi_1|wo)/kernel"
)
BASE_DTYPES = (None, "int8", "nf4")  # LoraConfig.base_dtype's values
NF4_TILE_SIZE = 64  # QLoRA's NF4 block (Dettmers et al., 2023): one scale per 64 inputs
# base_dtype -> its tile_size when LoraConfig.tile_size is None (0: one scale per output channel)
DEFAULT_TILE_SIZES = {"int8": 0, "nf4": NF4_TILE_SIZE}
METHODS = ("__call__", "logits", "encode", "decode")  # the model methods that get adapters
ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")  # Qwix's names: kernel `W` -> `W_lora_a`, `W_lora_b`


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What `apply_lora` adds; each field is checked on creation, the error naming it."""

    rank: int = 8  # r
    alpha: float = 16.0  # the update is (x A) B alpha / rank
    dropout: float = 0.0  # on the adapters' input x, with train=True (rng stream "dropout")
    targets: str = DEFAULT_TARGETS  # a regex, fully matched against "/"-joined parameter paths
    base_dtype: str | None = None  # QLoRA: "int8" or "nf4" stores the targeted kernels quantized
    tile_size: int | None = None  # QLoRA: one scale per this many inputs of each output
    # channel; 0: one scale per output channel; None: base_dtype's (DEFAULT_TILE_SIZES: nf4 64)

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be a positive int, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")
        try:
            re.compile(self.targets)
        except (re.error, TypeError) as e:
            raise ValueError(f"LoraConfig.targets={self.targets!r} is not a regex: {e}") from None
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(
                f"LoraConfig.base_dtype={self.base_dtype!r} is unknown; allowed: {BASE_DTYPES}"
            )
        if self.tile_size is not None and (
            isinstance(self.tile_size, bool)
            or not isinstance(self.tile_size, int)
            or self.tile_size < 0
        ):
            raise ValueError(
                f"LoraConfig.tile_size must be an int >= 0 (0: one scale per output channel) "
                f"or None (base_dtype's default), got {self.tile_size!r}"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def block_size(self) -> int | None:
        """The inputs per scale of the quantized kernels (Qwix's tile_size): tile_size, or
        base_dtype's default when None; None: one scale per output channel, or no quantization."""
        if self.base_dtype is None:
            return None
        size = self.tile_size if self.tile_size is not None else DEFAULT_TILE_SIZES[self.base_dtype]
        return size or None


def flat_params(params) -> dict:
    """`params` as one dict {path tuple: leaf}."""
    return flax.traverse_util.flatten_dict(flax.core.unfreeze(params))


# ----------------------------------------------------------------------------------------------
# QLoRA's checks: before any work, and on every later load of a run's base.


def check_tile_size(config: LoraConfig, params, name: str = "LoraConfig") -> None:
    """QLoRA: each adapted kernel's inputs (its matmul's contracting width: D of query_kernel,
    N H of out_kernel, F of mlp/wo) must split into whole blocks of `config.block_size`.
    `params`: the LoRA model's params or their ShapeDtypeStructs, boxed or not (from an
    abstract init, which may run without base_dtype: no device needed), whose adapters A
    [*L, in, r] give each kernel's width (tfjax's matmuls contract one axis). One ValueError
    naming `name`.tile_size, every kernel that does not fit with its width, and the values
    that fit them all."""
    size = config.block_size
    if size is None:
        return
    suffix = ADAPTER_SUFFIXES[0]
    widths = {
        "/".join(map(str, (*path[:-1], path[-1][: -len(suffix)]))): int(leaf.shape[-2])
        for path, leaf in flat_params(nn.unbox(params)).items()
        if str(path[-1]).endswith(suffix)
    }
    if any(width % size for width in widths.values()):
        raise ValueError(tile_size_error(config, widths, name))


def tile_size_error(config: LoraConfig, widths: dict[str, int], name="LoraConfig") -> str:
    """The line refusing `config.block_size` for the kernels `widths` {path: inputs}."""
    size, field = config.block_size, f"{name}.tile_size"
    given = (
        f"{field}={config.tile_size}"
        if config.tile_size is not None
        else f"{field} unset ({config.base_dtype}'s default: {size}, QLoRA's block)"
    )
    bad = sorted(path for path, width in widths.items() if width % size)
    listed = ", ".join(f"{path} ({widths[path]})" for path in bad[:4])
    if len(bad) > 4:
        listed += f", and {len(bad) - 4} more"
    common = math.gcd(*widths.values())
    divisors = [d for d in range(common, 0, -1) if common % d == 0][:4]
    return (
        f"{given}: {len(bad)} adapted kernel(s) of base_dtype={config.base_dtype!r} have a "
        f"number of inputs that is not a multiple of {size} (each output channel's inputs are "
        f"quantized in blocks of tile_size, one scale each): {listed}; set {field} to 0 (one "
        f"scale per output channel) or to a divisor of {common}, what every adapted kernel's "
        f"inputs divide by ({', '.join(map(str, divisors))}{', ...' if common > 4 else ''})"
    )


def _quantized_as(config: LoraConfig) -> str:
    """How `config` stores its base: "float (lora.base_dtype='')", "quantized as nf4 in
    blocks of 64 inputs (lora.base_dtype='nf4', lora.tile_size unset)", ..."""
    if config.base_dtype is None:
        return "float (lora.base_dtype='')"
    blocks = (
        f"in blocks of {config.block_size} inputs"
        if config.block_size
        else "with one scale per output channel"
    )
    tile = "unset" if config.tile_size is None else config.tile_size
    return (
        f"quantized as {config.base_dtype} {blocks} (lora.base_dtype={config.base_dtype!r}, "
        f"lora.tile_size {tile})"
    )


def check_quantization_kept(trained: LoraConfig | None, now: LoraConfig | None, where: str):
    """A run's adapters belong to its base quantized as it was when they were trained: a
    resumed or decoded run (config `now`) must quantize it as `trained` did (the config the
    workdir recorded, in the file `where`): the same base_dtype and block size. Else one
    ValueError naming lora.base_dtype and lora.tile_size, both quantizations, and the flags that
    give the trained one; this is also how a workdir from before nf4's default became QLoRA's
    blocks of 64 (it recorded lora.tile_size=0: one scale per output channel) is told apart."""
    if trained is None or now is None:
        return
    if (trained.base_dtype, trained.block_size) == (now.base_dtype, now.block_size):
        return
    raise ValueError(
        f"lora.base_dtype / lora.tile_size: this run's adapters were trained on its base "
        f"{_quantized_as(trained)} ({where}), but this config makes it "
        f"{_quantized_as(now)}; give --config.lora.base_dtype={trained.base_dtype or ''} "
        f"--config.lora.tile_size={trained.block_size or 0}, the base the adapters belong to"
    )
