r"""Peak host memory while a run loads a Hugging Face checkpoint (config.init_from): streamed
tensor by tensor (tfjax.runner.pretrained.load_params) against reading the whole state dict
first (interop.pretrained.pretrained_params, then placing; what load_params did before it streamed).

    .venv/bin/python benchmarks/load_memory.py [--layers=16] [--width=1024] [--scan_layers]
        [--tiny]

A Llama-shaped checkpoint of random weights is written by transformers (float32, so the
checkpoint's bytes are the placed params' bytes), then each way loads it in a fresh process onto
the process's CPU device, with the run's shardings. Each process measures its anonymous
resident memory (RssAnon: what the process allocated, not the pages of the memory-mapped
safetensors files, which the kernel can drop at any time) before loading and its peak during the
load (sampled every millisecond by a thread). On the CPU the placed params themselves live in
host memory, so the figure that tells whether a second copy of the model was held is

    extra copies = (peak - before - placed params' bytes) / checkpoint bytes

(0: nothing but the placed params; 1: a whole extra copy). The issue's bar for streaming: well
under 1. Writes benchmarks/results/load_memory.json (or --out).
"""

import json
import os
import subprocess
import sys
import tempfile
import threading

import harness

WAYS = ("whole", "streamed")
GiB = 2**30


def write_checkpoint(directory: str, layers: int, width: int, vocab: int) -> int:
    """A random LlamaForCausalLM saved by transformers; its weights' bytes."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=max(width // 64, 1),
        num_key_value_heads=max(width // 256, 1),
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):  # no init compute: the weights are filled below
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


class PeakSampler:
    """The largest RssAnon seen while the `with` block runs (sampled every millisecond)."""

    def __enter__(self):
        self.peak, self._stop = _status("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status("RssAnon"))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def child(way: str, checkpoint: str, scan_layers: bool) -> dict:
    """Loads `checkpoint` the given way in this process; its memory figures."""
    import flax.linen as nn
    import jax
    import numpy as np
    from flax import traverse_util

    from tfjax.interop.pretrained import pretrained_model, pretrained_params
    from tfjax.runner import pretrained

    found = pretrained.Pretrained.read(checkpoint, checkpoint)
    model = pretrained_model(checkpoint, scan_layers=scan_layers)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 8), np.int32)))
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
        nn.unbox(shapes["params"]),
    )
    before = _status("RssAnon")
    with PeakSampler() as sampler:
        if way == "streamed":
            params = pretrained.load_params(found, model, abstract)
        else:
            loaded = traverse_util.flatten_dict(pretrained_params(checkpoint, model))
            placed = {}
            for k, a in traverse_util.flatten_dict(abstract).items():
                x = np.asarray(loaded[k]).astype(a.dtype)
                placed[k] = jax.make_array_from_callback(a.shape, a.sharding, lambda i, x=x: x[i])
            params = traverse_util.unflatten_dict(placed)
            del loaded
        jax.block_until_ready(params)
    leaves = jax.tree.leaves(params)
    return dict(
        before=before,
        peak=sampler.peak,
        placed=sum(x.size * x.dtype.itemsize for x in leaves),
        leaves=len(leaves),
    )


def main():
    parser = harness.parser(__doc__, "load_memory")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--scan_layers", action="store_true", help="the run's stacked layout")
    parser.add_argument("--child", choices=WAYS, help=argparse_hidden())
    parser.add_argument("--checkpoint", help=argparse_hidden())
    args = parser.parse_args()
    if args.child:
        print(harness.REPLY + json.dumps(child(args.child, args.checkpoint, args.scan_layers)))
        return
    if args.tiny:
        args.layers, args.width, args.vocab = 2, 128, 1000
    result = harness.header("load_memory", args, "jax", "safetensors", "transformers")
    with tempfile.TemporaryDirectory() as tmp:
        size = write_checkpoint(tmp, args.layers, args.width, args.vocab)
        harness.log(
            f"checkpoint: {size / GiB:.3f} GiB (Llama, {args.layers} layers, width "
            f"{args.width}, float32); scan_layers={args.scan_layers}"
        )
        rows = {}
        for way in WAYS:
            command = [sys.executable, __file__, f"--child={way}", f"--checkpoint={tmp}"]
            command += ["--scan_layers"] * args.scan_layers
            env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=harness.ROOT)
            proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            replies = [ln for ln in proc.stdout.splitlines() if ln.startswith(harness.REPLY)]
            if proc.returncode or not replies:
                raise RuntimeError(f"{way}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
            row = json.loads(replies[-1][len(harness.REPLY) :])
            row["extra_copies"] = (row["peak"] - row["before"] - row["placed"]) / size
            rows[way] = row
    harness.log(f"{'way':10} {'before GiB':>11} {'peak GiB':>9} {'placed GiB':>11} {'extra':>7}")
    for way, r in rows.items():
        harness.log(
            f"{way:10} {r['before'] / GiB:11.3f} {r['peak'] / GiB:9.3f} "
            f"{r['placed'] / GiB:11.3f} {r['extra_copies']:7.2f}"
        )
    harness.log(
        harness.ratio_line(
            "extra copies streamed", rows["streamed"]["extra_copies"], digits=2, at_most=0.5
        )
    )
    growth = {w: r["peak"] - r["before"] for w, r in rows.items()}
    harness.log(
        harness.ratio_line(
            "load peak growth streamed/whole", growth["streamed"] / growth["whole"], digits=2
        )
    )
    result.update(checkpoint_bytes=size, layers=args.layers, width=args.width, rows=rows)
    harness.write_json(args.out, result)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
