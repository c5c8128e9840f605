"""Accelerators as data: peak bf16 matmul FLOP/s and memory per chip, from the vendors' pages.

    chip = chips.of(device)              # from a real or a compile-only device
    chip.hbm_bytes, chip.peak_flops      # per JAX device
    chips.peak_flops(mesh, jnp.bfloat16) # the mesh's total: the table, or measured on CPUs

MFU on an accelerator is model FLOPs per second over the table's peak (the convention of
PaLM and MaxText), so a run's MFU does not depend on a measurement taken on a busy device. On
CPUs, which have no such figure, the peak is the matmul rate measured in the same run
(`measure_peak_flops`).

Model FLOPs (`training_flops_per_example`) follow Kaplan et al. / PaLM: 6 * N * T for the
weight matmuls (forward 2, backward 4 per parameter per token) plus 12 * L * T * S * D for
attention scores and values (decoders: S at most a layer's sliding window or chunk, latent
attention's keys of Hn + Hr, Gated DeltaNet layers linear in T); embedding lookups count
nothing, a tied output projection counts as a matmul. N counts the parameters a token uses:
of a mixture of experts' expert kernels, top_k / num_experts
(`tfjax.nn.moe.active_parameters`). MFU is model FLOPs per second over `peak_flops`.

Sources: Google Cloud's TPU system-architecture pages (v4: 275 TFLOP/s bf16, 32 GiB HBM per
chip, two TensorCores; v5e: 197 TFLOP/s, 16 GiB; v5p: 459 TFLOP/s, 95 GiB; v6e / Trillium:
918 TFLOP/s, 32 GiB) and NVIDIA's data sheets (dense bf16 tensor-core rates without sparsity:
A100 312 TFLOP/s, H100 SXM 989 TFLOP/s, H200 989 TFLOP/s; memory as nvidia-smi reports it:
A100 80GB 81,920 MiB, H100 80GB 81,559 MiB, H200 143,771 MiB).

What XLA's GPU compiler needs to compile for a GPU that is not here (`Gpu`): NVIDIA's A100
and H100 architecture whitepapers and H200 data sheet (streaming multiprocessors, boost clock,
L2 cache, memory bandwidth: A100 SXM 80GB 108 SMs, 1.41 GHz, 40 MB, 2.04 TB/s; H100 SXM 132
SMs, 1.98 GHz, 50 MB, 3.35 TB/s; H200 as H100 with 4.8 TB/s) and the CUDA programming guide's
per-compute-capability limits (shared memory per SM 164 KB on 8.0 and 228 KB on 9.0, 1 KB less
per block opted in; 64K registers and 2,048 threads per SM; FP32 lanes per SM 64 on 8.0 and
128 on 9.0).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.nn import moe

GiB = 2**30
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Gpu:
    """An NVIDIA GPU as XLA's GPU compiler models it (for compiling without the GPU)."""

    device_kind: str  # as JAX reports it on the real GPU
    compute_capability: tuple[int, int]
    sms: int
    clock_ghz: float
    l2_bytes: int
    memory_bandwidth: float  # bytes/s
    fp32_lanes_per_sm: int
    shared_memory_per_sm: int  # bytes


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # as tfjax writes it: "v5e", "H100"
    peak_flops: float  # dense bf16 matmul FLOP/s of one chip
    hbm_bytes: int  # accelerator memory of one chip
    cores: int = 1  # TensorCores per chip that compile-only topologies show as separate devices
    gpu: Gpu | None = None  # what XLA needs to compile for it (GPUs)


# device_kind prefix (as JAX reports it) -> the chip. Longer prefixes first where they overlap.
CHIPS: dict[str, Chip] = {
    "TPU v4": Chip("v4", 275e12, 32 * GiB, cores=2),
    "TPU v5 lite": Chip("v5e", 197e12, 16 * GiB),
    "TPU v5e": Chip("v5e", 197e12, 16 * GiB),
    "TPU v5p": Chip("v5p", 459e12, 95 * GiB),
    "TPU v5": Chip("v5p", 459e12, 95 * GiB),
    "TPU v6 lite": Chip("v6e", 918e12, 32 * GiB),
    "TPU v6e": Chip("v6e", 918e12, 32 * GiB),
    "NVIDIA A100": Chip(
        "A100",
        312e12,
        81_920 * MiB,
        gpu=Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1.41, 40 * MiB, 2.039e12, 64, 164 * 1024),
    ),
    "NVIDIA H100": Chip(
        "H100",
        989e12,
        81_559 * MiB,
        gpu=Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 50 * MiB, 3.35e12, 128, 228 * 1024),
    ),
    "NVIDIA H200": Chip(
        "H200",
        989e12,
        143_771 * MiB,
        gpu=Gpu("NVIDIA H200", (9, 0), 132, 1.98, 50 * MiB, 4.8e12, 128, 228 * 1024),
    ),
}


def gpu_chip(name: str) -> Chip | None:
    """The table's GPU called `name` ("h100", any case), or None."""
    return next((c for c in CHIPS.values() if c.gpu and c.name.lower() == name.lower()), None)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One JAX device's share of its chip (a v4 compile-only device is one TensorCore)."""

    chip: Chip
    peak_flops: float
    hbm_bytes: int


def of(device, devices=None) -> DeviceSpec | None:
    """The table's figures for one device (None: not an accelerator the table knows).

    `devices` (all of the mesh's) tell whether the chip's TensorCores are separate devices, as
    in v4 compile-only topologies (one device per core); a real v4 shows one device per chip.
    """
    kind = getattr(device, "device_kind", "")
    chip = next((c for prefix, c in CHIPS.items() if kind.startswith(prefix)), None)
    if chip is None:
        return None
    cores = {getattr(d, "core_on_chip", 0) for d in (devices or [device])}
    share = len(cores) if chip.cores > 1 else 1
    return DeviceSpec(chip, chip.peak_flops / share, chip.hbm_bytes // share)


@dataclasses.dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s of all the mesh's devices together
    source: str  # "v5e table (197 TFLOP/s per chip)" or "measured"


def peak_flops(mesh, dtype) -> Peak:
    """The mesh's peak matmul FLOP/s: the table's on a known accelerator, else measured."""
    devices = list(mesh.devices.flat)
    spec = of(devices[0], devices)
    if spec is not None:
        chip = spec.chip
        source = f"{chip.name} table, {chip.peak_flops / 1e12:.0f} TFLOP/s bf16 per chip"
        return Peak(spec.peak_flops * len(devices), source)
    return Peak(measure_peak_flops(mesh, dtype), "measured matmul rate")


def describe(devices) -> str:
    """ "8 x TPU v5 lite (v5e: 16.0 GiB, 197 TFLOP/s bf16 each)" for a report."""
    devices = list(devices)
    d = devices[0]
    spec = of(d, devices)
    if spec is None:
        return f"{len(devices)} x {d.device_kind}"
    return (
        f"{len(devices)} x {d.device_kind} ({spec.chip.name}: {spec.hbm_bytes / GiB:.1f} GiB, "
        f"{spec.peak_flops / 1e12:.0f} TFLOP/s bf16 each)"
    )


# ---------------------------------------------------------------------------------- FLOPs, MFU
def _count(tree) -> int:
    return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree))


def training_flops_per_example(model, params, example: dict) -> float:
    """Model FLOPs of one training example (forward + backward) for the tfjax model families.

    Args:
      model: a tfjax.models Decoder, Encoder, Transformer or VisionTransformer.
      params: its parameters (arrays or ShapeDtypeStructs).
      example: {batch key: shape} of one batch (only lengths and image sizes are read).
    """
    kind = type(model).__name__
    d, layers = model.width, model.num_layers
    if getattr(model, "head_dim", None):  # attention's width N * H, not D (T5, Qwen 3, Gemma)
        d_attention = model.num_heads * model.head_dim
    else:
        d_attention = d
    if kind == "VisionTransformer":
        _, h, w, c = example["image"]
        p = model.patch_size
        n = (h // p) * (w // p)
        t = n + (1 if model.pool in ("cls", "cls_gap") else 0)
        dense = _count(params["encoder"]) * t + d * c * p * p * n
        dense += _count(params.get("head", {}))
        attention = layers * t * t * d_attention
    elif kind == "Transformer":
        s, t = example["inputs"][1], example["targets"][1]
        out = _count(params["output_proj"]) if "output_proj" in params else model.vocab_size * d
        dense = _count(params["encoder"]) * s + _count(params["decoder"]) * t + out * t
        attention = layers * (s * s + t * t + t * s) * d_attention
    elif kind in ("Decoder", "Encoder"):
        t = example["tokens"][1]
        # the decoder's stacks by name (DeepSeek's dense_decoder, Qwen3.5's runs of one type)
        names = tuple(n for n, *_ in model.spec.stacks()) if kind == "Decoder" else ("encoder",)
        stack = {name: params[name] for name in names if name in params}
        if getattr(model, "num_experts", 0):
            layer_params = moe.active_parameters(stack, model.experts_per_token, model.num_experts)
        else:
            layer_params = _count(stack)
        if kind == "Decoder":
            tied = "output_proj" not in params
            out = model.vocab_size * d if tied else _count(params["output_proj"])
        elif model.head == "mlm":
            out = _count(params["mlm_dense"]) + model.vocab_size * d
        else:
            out = (_count(params["pooler"]) + _count(params["classifier"])) / t
        dense = layer_params * t + out * t
        if kind == "Decoder":
            return 3.0 * (2.0 * dense + _decoder_mixing_flops(model, t))
        attention = layers * t * t * d_attention
    else:
        raise ValueError(f"no FLOP count for model type {kind}")
    # forward: 2 per weight and token; attention: Q K^T and weights V, 2 * T * S * N * H each.
    return 3.0 * (2.0 * dense + 4.0 * attention)


def _decoder_mixing_flops(model, t: int) -> float:
    """A decoder's forward FLOPs of token mixing beyond its weights for T tokens: attention
    layers 2 * T * S * N * (Hqk + Hv) (scores and weighted values; latent attention's keys are
    Hn + Hr wide, its values Hv), where S, the keys a query is scored against, is T, or at most
    the sliding window or the chunk (Llama 4) of the layers that have one; Gated DeltaNet layers
    6 * T * Nv * Hk * Hv (the recurrent form: the state read by the key, its update and its
    read by the query)."""
    types = model.layer_types or ("full_attention",) * model.num_layers
    linear = types.count("linear_attention")
    h = model.head_dim or model.width // model.num_heads
    if model.kv_lora_rank is not None:
        h_qk, h_v = h + model.qk_rope_head_dim, model.v_head_dim or h
    else:
        h_qk = h_v = h
    keys = sum(_keys_seen(model, i, t) for i, kind in enumerate(types) if kind == "full_attention")
    flops = 2.0 * t * keys * model.num_heads * (h_qk + h_v)
    if linear:
        heads, hk = model.linear_num_value_heads, model.linear_key_head_dim
        flops += 6.0 * linear * t * heads * hk * model.linear_value_head_dim
    return flops


def _keys_seen(model, layer: int, t: int) -> int:
    """How many keys a query of attention layer `layer` is scored against, for T tokens: a
    window or a chunk bounds it on the layers they apply to (with attention_pattern, its
    "local" ones)."""
    pattern = model.attention_pattern
    if pattern is not None and pattern[layer % len(pattern)] == "global":
        return t
    spans = [s for s in (model.sliding_window, model.attention_chunk_size) if s is not None]
    return min([t, *spans])


@functools.lru_cache(maxsize=8)
def measure_peak_flops(mesh, dtype=jnp.float32, *, size: int | None = None, repeats: int = 5):
    """Matmul FLOP/s of all the mesh's devices together (each multiplies its own matrices).

    The best of `repeats` timed runs of one [n, n] x [n, n] product per device; n is 512 on CPU
    and 4096 elsewhere, large enough to reach the matmul roofline. Measured once per process
    for a mesh and dtype.
    """
    n = size or (512 if jax.default_backend() == "cpu" else 4096)
    devices = mesh.devices.size
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
    x = jax.jit(lambda k: jax.random.normal(k, (devices, n, n), dtype), out_shardings=sharding)(
        jax.random.key(0)
    )
    matmul = jax.jit(lambda a: jnp.einsum("dij,djk->dik", a, a), out_shardings=sharding)
    matmul(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 * devices / best
