r"""Train-step time of tfjax against PyTorch (eager, torch.compile) and stock flax.linen, on CPU.

    .venv/bin/python benchmarks/train_step_vs_torch.py [--models=decoder,vit,gpt2] [--rounds=N]
        [--contenders=tfjax,stock_flax,torch_eager,torch_compile] [--threads=N]
        [--malloc=keep|glibc] [--tiny]

One training step = forward, backward and an AdamW update (lr 1e-4, weight decay 0.01, no
clipping, no dropout), float32, on one fixed batch already in memory, for:

  decoder  GPT-like decoder: d=512, 8 heads, 6 layers, F=2048, V=8192, T=256, batch 4
  vit      ViT-S/16 at 224 px, 1000 classes, class token, learned positions, batch 8
  gpt2     GPT-2 small (124M; V=50257, tied output), T=128, batch 4

Contenders, the same shapes and init scale (normal 0.02 for the language models):
  tfjax          tfjax.models.{decoder,vit} from a config (configs/{lm,vit}.py with these
                 sizes), its train step, tfjax.optim's AdamW and donation from
                 tfjax.experiment.set_up, as the runner builds them
  stock_flax     the same network from flax.linen's nn.Embed / nn.Dense / nn.LayerNorm /
                 nn.MultiHeadDotProductAttention / nn.Conv, optax.adamw, jitted with donation
  torch_eager    Hugging Face GPT2LMHeadModel / ViTForImageClassification from a config (random
                 weights, SDPA attention), torch.optim.AdamW (foreach)
  torch_compile  the same torch module through torch.compile (inductor); the optimizer eager

Every contender runs in its own process (in one process, torch slowed the JAX contenders by
uneven amounts), started, compiled and warmed up one after another; then the timed steps run
in rounds, each round one step of every contender in a rotated order (so that the machine's
load drifts hit all alike) while the others wait idle, and the tables show medians.
Threads: torch.set_num_threads(threads) and XLA's own thread pool, which takes every core of
the process's CPU affinity; --threads below the core count pins each process to that many
cores first, so both libraries see the same. Host memory: every contender's process alike
keeps freed memory for reuse (tfjax.host_memory, as experiments/run.py does; --malloc=glibc
leaves glibc's defaults, which page-fault each step's temporaries in anew).

MFU = model FLOPs per step / step time / roofline. Model FLOPs follow tfjax.metrics
(Kaplan et al. / PaLM): 6 * N * T for the weight matmuls (N = non-embedding parameters plus
the output projection; embedding lookups count nothing) plus 12 * L * T * S * D for attention
scores and values (causal masking not discounted). The roofline is the fastest float32
[n, n] x [n, n] matmul (n = 512, 1024, 2048; best of 5) measured in this run by JAX and by
torch, before and after the timed rounds. Beside it, the MFU of a step that did nothing but
its matmuls (step_matmuls: every forward, input-gradient and weight-gradient product), each as
fast as it runs alone, with JAX's and with torch's kernels: the ceiling those kernels set.

Prints versions, the machine, step times, ratios and MFU; writes benchmarks/results/
train_step_vs_torch.json (or --out). --tiny runs toy sizes for the smoke test.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONTENDERS = ("tfjax", "stock_flax", "torch_eager", "torch_compile")
# kind "lm": a GPT-2-style decoder (learned positions, pre-LN, tanh-GELU, tied output);
# kind "vit": ViT with a class token and learned positions, exact GELU, LayerNorm eps 1e-6.
MODELS = {
    "decoder": dict(kind="lm", width=512, layers=6, heads=8, mlp=2048, vocab=8192, length=256,
                    max_len=256, batch=4),
    "vit": dict(kind="vit", width=384, layers=12, heads=6, mlp=1536, image=224, patch=16,
                classes=1000, batch=8),
    "gpt2": dict(kind="lm", width=768, layers=12, heads=12, mlp=3072, vocab=50257, length=128,
                 max_len=1024, batch=4),
}  # fmt: skip
TINY = {
    "decoder": dict(kind="lm", width=32, layers=2, heads=4, mlp=128, vocab=256, length=16,
                    max_len=16, batch=2),
    "vit": dict(kind="vit", width=32, layers=2, heads=4, mlp=64, image=32, patch=16, classes=10,
                batch=2),
    "gpt2": dict(kind="lm", width=48, layers=2, heads=4, mlp=192, vocab=512, length=16,
                 max_len=32, batch=2),
}  # fmt: skip
# Targets of issue 9: contender -> the largest allowed tfjax / contender step-time ratio.
TARGETS = {
    "decoder": {"torch_eager": 1.0},
    "vit": {"torch_eager": 1.0},
    "gpt2": {"torch_eager": 0.85, "stock_flax": 0.95},
}
MFU_TARGET = {"gpt2": 0.75}
LR, WEIGHT_DECAY = 1e-4, 0.01


def _pin_threads(threads):
    """Restricts the process to `threads` cores before JAX or torch start their pools."""
    cores = sorted(os.sched_getaffinity(0))
    if threads and threads < len(cores):
        os.sched_setaffinity(0, cores[:threads])
    return len(os.sched_getaffinity(0))


# ------------------------------------------------------------------------------------- data
def make_batch(spec, seed=0):
    """numpy batch: lm {"tokens" [B, T] in [1, V)}; vit {"image" [B, H, W, 3], "label" [B]}."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if spec["kind"] == "lm":
        tokens = rng.integers(1, spec["vocab"], (spec["batch"], spec["length"]), dtype=np.int32)
        return {"tokens": tokens}
    s = spec["image"]
    return {
        "image": rng.standard_normal((spec["batch"], s, s, 3), dtype=np.float32),
        "label": rng.integers(0, spec["classes"], (spec["batch"],), dtype=np.int32),
    }


# ------------------------------------------------------------------------------------ tfjax
def tfjax_config(spec, **model_overrides):
    """The config of a tfjax run of `spec`: configs/lm.py:tiny (decoder) or configs/vit.py:tiny
    (ViT) with the spec's sizes, batch and AdamW (lr LR, weight decay WEIGHT_DECAY, constant,
    no clipping), no dropout, no label smoothing or z-loss, float32, a data-parallel mesh."""
    from tfjax import experiment

    if spec["kind"] == "lm":
        config = experiment.load_config(os.path.join(ROOT, "configs/lm.py") + ":tiny")
        model = dict(variant="gpt2-small", vocab_size=spec["vocab"], width=spec["width"],
                     num_layers=spec["layers"], num_heads=spec["heads"], mlp_dim=spec["mlp"],
                     max_len=spec["max_len"], dropout_rate=0.0)  # fmt: skip
    else:
        config = experiment.load_config(os.path.join(ROOT, "configs/vit.py") + ":tiny")
        model = dict(variant=f"S/{spec['patch']}", num_classes=spec["classes"],
                     width=spec["width"], num_layers=spec["layers"], num_heads=spec["heads"],
                     mlp_dim=spec["mlp"], pool="cls", posemb="learned", dropout_rate=0.0,
                     head_zero_init=False)  # fmt: skip
    with config.unlocked():  # head_zero_init is not a field of configs/vit.py
        config.model.update(model, **model_overrides)
        config.update(batch_size=spec["batch"], eval_batch_size=spec["batch"],
                      num_train_steps=10**6, dtype="float32")  # fmt: skip
        config.loss.update(label_smoothing=0.0, z_loss=0.0)
        config.optim.update(name="adamw", learning_rate=LR, schedule="constant",
                            warmup_steps=0, end_learning_rate_fraction=1.0, b1=0.9, b2=0.999,
                            eps=1e-8, weight_decay=WEIGHT_DECAY, grad_clip_norm=0.0,
                            ema_decay=0.0)  # fmt: skip
        config.mesh.update(data=-1, fsdp=1, tensor=1)
    return config


def tfjax_inputs(spec):
    """experiment.Inputs of make_batch(spec)'s batches (their shapes and dtypes)."""
    import jax
    import numpy as np

    from tfjax import experiment

    def sds(*shape, dtype):
        return jax.ShapeDtypeStruct((spec["batch"], *shape), dtype)

    if spec["kind"] == "lm":
        batch = {"tokens": sds(spec["length"], dtype=np.int32)}
        return experiment.Inputs(train=batch, eval=batch, vocab_size=spec["vocab"])
    s = spec["image"]
    batch = {"image": sds(s, s, 3, dtype=np.float32), "label": sds(dtype=np.int32)}
    return experiment.Inputs(train=batch, eval=batch, num_classes=spec["classes"])


def set_up_tfjax(spec, **model_overrides):
    """tfjax.experiment.set_up of tfjax_config(spec) on one device."""
    import jax

    from tfjax import experiment, sharding

    config = tfjax_config(spec, **model_overrides)
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    return experiment.set_up(config, mesh, inputs=tfjax_inputs(spec))


def build_tfjax(spec, batch_np):
    """(step() -> loss, model FLOPs per step, parameter count) for tfjax's own train step."""
    import jax

    from tfjax import sharding

    exp = set_up_tfjax(spec)
    box = [exp.init(jax.random.key(0))]
    batch = sharding.shard_batch(batch_np, exp.mesh, exp.rules)
    key = jax.random.key(1)

    def step():
        box[0], stats = exp.train_step(box[0], batch, key)
        jax.block_until_ready((box[0], stats))
        return float(stats["loss"]) / float(stats["weight"])

    step.lower = lambda: exp.train_step.lower(box[0], batch, key)  # for profiling
    return step, exp.flops_per_step, exp.num_params


# ------------------------------------------------------------------------------- stock flax
def stock_flax_modules():
    """GPT-2-style decoder and ViT built only from stock flax.linen layers."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Block(nn.Module):
        heads: int
        mlp: int
        eps: float
        approximate_gelu: bool
        kernel_init: object

        @nn.compact
        def __call__(self, x, mask=None):
            y = nn.LayerNorm(epsilon=self.eps)(x)
            y = nn.MultiHeadDotProductAttention(
                num_heads=self.heads, kernel_init=self.kernel_init, deterministic=True
            )(y, mask=mask)
            x = x + y
            y = nn.LayerNorm(epsilon=self.eps)(x)
            y = nn.Dense(self.mlp, kernel_init=self.kernel_init)(y)
            y = jax.nn.gelu(y, approximate=self.approximate_gelu)
            return x + nn.Dense(x.shape[-1], kernel_init=self.kernel_init)(y)

    class GPT(nn.Module):
        vocab: int
        width: int
        layers: int
        heads: int
        mlp: int
        max_len: int

        @nn.compact
        def __call__(self, tokens):
            init = nn.initializers.normal(0.02)
            embed = nn.Embed(self.vocab, self.width, embedding_init=init)
            pos = nn.Embed(self.max_len, self.width, embedding_init=init)
            # [B, T, D]
            x = embed(tokens) + pos(jnp.arange(tokens.shape[1]))[None]
            mask = nn.make_causal_mask(tokens)
            for _ in range(self.layers):
                x = Block(self.heads, self.mlp, 1e-5, True, init)(x, mask)
            x = nn.LayerNorm(epsilon=1e-5)(x)
            # [B, T, V]
            return embed.attend(x)

    class ViT(nn.Module):
        classes: int
        patch: int
        width: int
        layers: int
        heads: int
        mlp: int

        @nn.compact
        def __call__(self, images):
            p = self.patch
            x = nn.Conv(self.width, (p, p), strides=(p, p), padding="VALID")(images)
            b, gh, gw, d = x.shape
            # [B, P, D]
            x = x.reshape(b, gh * gw, d)
            cls = self.param("cls", nn.initializers.zeros, (1, 1, d))
            # [B, 1 + P, D]
            x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, d)), x], axis=1)
            x = x + self.param("pos_embed", nn.initializers.normal(0.02), (1, x.shape[1], d))
            for _ in range(self.layers):
                x = Block(self.heads, self.mlp, 1e-6, False, nn.initializers.xavier_uniform())(x)
            x = nn.LayerNorm(epsilon=1e-6)(x)
            return nn.Dense(self.classes)(x[:, 0])

    return GPT, ViT


def build_stock_flax(spec, batch_np):
    import jax
    import jax.numpy as jnp
    import optax

    gpt, vit_cls = stock_flax_modules()
    if spec["kind"] == "lm":
        model = gpt(spec["vocab"], spec["width"], spec["layers"], spec["heads"], spec["mlp"],
                    spec["max_len"])  # fmt: skip

        def loss_fn(params, batch):
            logits = model.apply({"params": params}, batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], batch["tokens"][:, 1:]
            ).mean()

        x = batch_np["tokens"]
    else:
        model = vit_cls(spec["classes"], spec["patch"], spec["width"], spec["layers"],
                        spec["heads"], spec["mlp"])  # fmt: skip

        def loss_fn(params, batch):
            logits = model.apply({"params": params}, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        x = batch_np["image"]
    tx = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)

    def init(rng):
        params = model.init(rng, jnp.asarray(x))["params"]
        return params, tx.init(params)

    def train_step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    step_fn = jax.jit(train_step, donate_argnums=0)
    box = [jax.jit(init)(jax.random.key(0))]
    batch = jax.tree.map(jnp.asarray, batch_np)

    def step():
        box[0], loss = step_fn(box[0], batch)
        jax.block_until_ready((box[0], loss))
        return float(loss)

    step.lower = lambda: step_fn.lower(box[0], batch)  # for profiling
    n_params = sum(a.size for a in jax.tree.leaves(box[0][0]))
    return step, n_params


# ------------------------------------------------------------------------------------ torch
def build_torch(spec, batch_np, *, compiled):
    """(step, parameter count) of the HF module, eager or through torch.compile."""
    import torch
    import torch.nn.functional as F
    import transformers

    torch.manual_seed(0)
    if spec["kind"] == "lm":
        config = transformers.GPT2Config(
            vocab_size=spec["vocab"], n_positions=spec["max_len"], n_embd=spec["width"],
            n_layer=spec["layers"], n_head=spec["heads"], n_inner=spec["mlp"],
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            layer_norm_epsilon=1e-5, initializer_range=0.02, use_cache=False, bos_token_id=0,
            eos_token_id=0, loss_type="ForCausalLM",
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        inputs = torch.from_numpy(batch_np["tokens"]).long()

        def loss_of(m):
            return m(input_ids=inputs, labels=inputs, use_cache=False).loss

    else:
        config = transformers.ViTConfig(
            hidden_size=spec["width"], num_hidden_layers=spec["layers"],
            num_attention_heads=spec["heads"], intermediate_size=spec["mlp"],
            image_size=spec["image"], patch_size=spec["patch"], num_labels=spec["classes"],
            hidden_act="gelu", layer_norm_eps=1e-6, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, qkv_bias=True, initializer_range=0.02,
        )  # fmt: skip
        model = transformers.ViTForImageClassification(config)
        # [B, C, H, W]: torch's layout
        images = torch.from_numpy(batch_np["image"]).permute(0, 3, 1, 2).contiguous()
        labels = torch.from_numpy(batch_np["label"]).long()

        def loss_of(m):
            return F.cross_entropy(m(pixel_values=images).logits, labels)

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WEIGHT_DECAY, foreach=True)  # fmt: skip

    stepped = torch.compile(model) if compiled else model

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(stepped)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------ the roofline
def best_matmul_s(shape, repeats=5):
    """{"jax": s, "torch": s}: best of `repeats` float32 products [g, m, k] x [g, k, n] (2-D when
    g == 1) on random operands, JAX's and torch's interleaved like the contenders."""
    import jax
    import jax.numpy as jnp
    import torch

    g, m, k, n = shape
    batch = (g,) if g > 1 else ()
    a = jax.random.normal(jax.random.key(0), (*batch, m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (*batch, k, n), jnp.float32)
    ta, tb = torch.randn(*batch, m, k), torch.randn(*batch, k, n)
    mm = jax.jit(jnp.matmul)
    run = {"jax": lambda: mm(a, b).block_until_ready(), "torch": lambda: ta @ tb}
    best = {}
    for lib, fn in run.items():
        fn()  # compiles (JAX) and warms up
        best[lib] = float("inf")
    for _ in range(repeats):
        for lib, fn in run.items():
            start = time.perf_counter()
            fn()
            best[lib] = min(best[lib], time.perf_counter() - start)
    return best


def roofline(sizes=(512, 1024, 2048), repeats=5):
    """{"jax n": FLOP/s, "torch n": FLOP/s}: best of `repeats` float32 square matmuls."""
    out = {}
    for n in sizes:
        for lib, seconds in best_matmul_s((1, n, n, n), repeats).items():
            out[f"{lib} {n}"] = 2.0 * n**3 / seconds
    return out


def step_matmuls(spec):
    """{(batch, m, k, n): count} of the matmul products of one train step: every forward
    product [m, k] x [k, n] (weights, attention scores and values, the output layer) and its
    two backward products (input gradient [m, n] x [n, k], weight gradient [k, m] x [m, n])."""
    b, d, f, layers = spec["batch"], spec["width"], spec["mlp"], spec["layers"]
    h = d // spec["heads"]
    if spec["kind"] == "lm":
        t, out = spec["length"], [(1, b * spec["length"], d, spec["vocab"])]
    else:
        n = (spec["image"] // spec["patch"]) ** 2
        t = n + 1
        out = [(1, b * n, 3 * spec["patch"] ** 2, d), (1, b, d, spec["classes"])]
    per_layer = [(1, b * t, d, d)] * 4 + [(1, b * t, d, f), (1, b * t, f, d)]
    per_layer += [(b * spec["heads"], t, h, t), (b * spec["heads"], t, t, h)]
    counts = {}
    for g, m, k, n in per_layer * layers + out:
        for shape in ((g, m, k, n), (g, m, n, k), (g, k, m, n)):
            counts[shape] = counts.get(shape, 0) + 1
    return counts


def matmul_time(counts, repeats=5):
    """{"jax": s, "torch": s}: the step's matmuls (step_matmuls) each timed alone
    (best_matmul_s), summed with their counts: the step time if it did nothing but its matmuls,
    each as fast as alone."""
    total = {"jax": 0.0, "torch": 0.0}
    for shape, count in counts.items():
        for lib, seconds in best_matmul_s(shape, repeats).items():
            total[lib] += count * seconds
    return total


# ------------------------------------------------------------------------------------- main
def machine_info(threads):
    import flax
    import jax
    import jaxlib
    import optax
    import torch
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu": cpu,
        "cores_visible": os.cpu_count(),
        "cores_used": threads,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "jax_backend": jax.default_backend(),
        "jax_devices": len(jax.devices()),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", ""),
        "load_average": os.getloadavg(),
    }


def build_contender(contender, spec, batch_np):
    """(step() -> loss, info) for one contender; info holds its parameter count (and FLOPs)."""
    if contender == "tfjax":
        step, flops, n = build_tfjax(spec, batch_np)
        return step, {"flops": flops, "params_tfjax": n}
    if contender == "stock_flax":
        step, n = build_stock_flax(spec, batch_np)
        return step, {"params_stock_flax": n}
    step, n = build_torch(spec, batch_np, compiled=contender == "torch_compile")
    return step, {"params_torch": n}


REPLY = "@@ "  # marks the worker's protocol lines on its stdout (libraries may print too)


def _reply(**fields):
    print(REPLY + json.dumps(fields, default=float), flush=True)


def worker(args, threads):
    """One contender in this process: build, compile, warm up, then time one step per "step"
    line on stdin until "quit"; each answer is a REPLY line of JSON. Only the contender's own
    library is imported."""
    if args.malloc == "keep":  # every contender alike, before its library starts threads
        from tfjax import host_memory

        host_memory.keep_freed_memory()
    if args.worker.startswith("torch"):
        import torch

        torch.set_num_threads(threads)
    else:
        import jax

        jax.config.update("jax_enable_compilation_cache", False)  # measure real compiles
    spec = (TINY if args.tiny else MODELS)[args.models]
    batch_np = make_batch(spec)
    try:
        start = time.perf_counter()
        step, info = build_contender(args.worker, spec, batch_np)
        info["build_s"] = time.perf_counter() - start
        start = time.perf_counter()
        info["first_loss"] = step()  # compiles (jit, torch.compile) and runs one step
        info["first_step_s"] = time.perf_counter() - start
        for _ in range(args.warmup):
            step()
    except Exception as e:  # a contender that cannot run here is reported, not fatal
        _reply(error=f"{type(e).__name__}: {str(e)[:2000]}")
        return
    _reply(ready=True, **info)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _reply(s=seconds, page_faults=usage.ru_minflt - faults, max_rss_kib=usage.ru_maxrss)


class Worker:
    """A contender in its own process (see worker()), so that no library's threads, allocator
    or JIT state slows another: in one process, torch slowed the JAX contenders unevenly."""

    def __init__(self, contender, model, args):
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), f"--worker={contender}",
             f"--models={model}", f"--warmup={args.warmup}", f"--threads={args.threads}",
             f"--malloc={args.malloc}",
             *(["--tiny"] if args.tiny else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
        )  # fmt: skip

    def ask(self, line=None):
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        for out in self.proc.stdout:
            if out.startswith(REPLY):
                return json.loads(out[len(REPLY) :])
        self.stderr.seek(0)
        tail = self.stderr.read()[-1500:]
        return {"error": f"worker exited with code {self.proc.wait()}: {tail}"}

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait()
        self.stderr.close()


def run_model(name, spec, entrants, *, rounds, log):
    """Starts, warms up and times the entrants on one model; returns its result dict.

    entrants: {label: (contender, args)}, one worker process each (the args set its flags, e.g.
    --malloc). They start one after another (so that compile times are not shared) and stay
    idle, waiting on stdin, while the others run."""
    workers, build_s, first_s, losses, info = {}, {}, {}, {}, {}
    try:
        for c, (contender, args) in entrants.items():
            w = Worker(contender, name, args)
            reply = w.ask()
            if "error" in reply:
                log(f"  {c}: did not start: {reply['error'][:500]}")
                info[f"{c}_error"] = reply["error"]
                w.close()
                continue
            workers[c] = w
            build_s[c], first_s[c] = reply.pop("build_s"), reply.pop("first_step_s")
            losses[c] = reply.pop("first_loss")
            info.update({k: v for k, v in reply.items() if k != "ready"})
            log(f"  {c}: built in {build_s[c]:.1f} s, first step (compile) {first_s[c]:.1f} s")
        names = list(workers)
        times, faults, rss = ({c: [] for c in names} for _ in range(3))
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for c in order:
                reply = workers[c].ask("step")
                if "error" in reply:
                    raise RuntimeError(f"{c} failed in round {r + 1}: {reply['error']}")
                times[c].append(reply["s"])
                faults[c].append(reply["page_faults"])
                rss[c].append(reply["max_rss_kib"])
            log(f"  round {r + 1}: " + ", ".join(f"{c} {1e3 * times[c][-1]:.0f} ms" for c in names))
    finally:
        for w in workers.values():
            w.close()
    median = {c: statistics.median(t) for c, t in times.items()}
    return dict(spec=spec, contenders=names, build_s=build_s, first_step_s=first_s,
                first_loss=losses, step_s=times, median_s=median, page_faults=faults,
                max_rss_gib={c: max(r) / 2**20 for c, r in rss.items()}, **info)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="decoder,vit,gpt2")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds (default 10, gpt2 6)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--threads", type=int, default=0, help="cores to use (0: all)")
    parser.add_argument(
        "--malloc", default="keep", choices=("keep", "glibc"),
        help="keep: every contender's process keeps freed memory for reuse "
        "(tfjax.host_memory, as experiments/run.py does); glibc: its defaults",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="toy sizes (smoke test)")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)  # see worker()
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results",
                                                      "train_step_vs_torch.json"))  # fmt: skip
    args = parser.parse_args()
    threads = _pin_threads(args.threads)
    # libgomp's default busy-waiting makes torch's 2-thread steps 100x slower when other
    # processes share the cores (measured: 650 ms vs 5 ms for a tiny step); sleep instead.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.worker:  # before importing torch here: a JAX contender's process never loads it
        return worker(args, threads)
    import torch

    torch.set_num_threads(threads)  # the roofline's torch matmuls
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contenders {unknown}; allowed: {CONTENDERS}")
    sizes = TINY if args.tiny else MODELS
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in sizes:
            parser.error(f"unknown model {m!r}; allowed: {list(sizes)}")

    def log(msg):
        print(msg, flush=True)

    info = machine_info(threads)
    info["malloc"] = args.malloc
    log("train step (forward + backward + AdamW), float32, CPU")
    log("  " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "load_average"))
    log(f"  load average at start: {info['load_average']}")
    peak_before = roofline(sizes=(128, 256) if args.tiny else (512, 1024, 2048))
    results = {}
    for m in models:
        spec = sizes[m]
        rounds = args.rounds or (3 if args.tiny else (6 if m == "gpt2" else 10))
        log(f"\n[{m}] {spec}; {rounds} rounds after {args.warmup} warm-up steps")
        entrants = {c: (c, args) for c in contenders}
        results[m] = run_model(m, spec, entrants, rounds=rounds, log=log)
    peak_after = roofline(sizes=(128, 256) if args.tiny else (512, 1024, 2048))
    peak_all = {k: max(peak_before[k], peak_after[k]) for k in peak_before}
    peak = max(peak_all.values())
    peak_src = max(peak_all, key=peak_all.get)

    log("\nmatmul roofline (float32 n x n, best of 5, before/after): " + ", ".join(
        f"{k}: {peak_before[k] / 1e9:.0f}/{peak_after[k] / 1e9:.0f}" for k in peak_before
    ) + f" GFLOP/s; roofline = {peak / 1e9:.1f} GFLOP/s ({peak_src})")  # fmt: skip
    summary = {}
    for m, r in results.items():
        flops = r.get("flops")
        log(f"\n[{m}] params: tfjax {r.get('params_tfjax', 0):,}, stock_flax "
            f"{r.get('params_stock_flax', 0):,}, torch {r.get('params_torch', 0):,}; "
            f"model FLOPs/step {flops / 1e9 if flops else float('nan'):.1f} G")  # fmt: skip
        log(f"  {'contender':14} {'compile+1st s':>13} {'median ms':>10} {'min ms':>9} "
            f"{'max ms':>9} {'GFLOP/s':>8} {'MFU':>6} {'page faults':>11}")  # fmt: skip
        mfu = {}
        for c in r["contenders"]:
            t = r["step_s"][c]
            med = r["median_s"][c]
            rate = flops / med if flops else float("nan")
            mfu[c] = rate / peak
            faults = statistics.median(r["page_faults"][c])
            log(f"  {c:14} {r['first_step_s'][c]:>13.1f} {1e3 * med:>10.1f} "
                f"{1e3 * min(t):>9.1f} {1e3 * max(t):>9.1f} {rate / 1e9:>8.1f} "
                f"{100 * mfu[c]:>5.1f}% {faults:>11,.0f}")  # fmt: skip
        counts = step_matmuls(r["spec"])
        matmul_flops = sum(2.0 * g * m * k * n * c for (g, m, k, n), c in counts.items())
        matmul_s = matmul_time(counts, repeats=2 if args.tiny else 5)
        ceiling = {lib: flops / t / peak if flops else float("nan") for lib, t in matmul_s.items()}
        log(f"  the step's matmuls alone ({matmul_flops / 1e9:.1f} GFLOP, {len(counts)} shapes, "
            f"best of {2 if args.tiny else 5} each): JAX {1e3 * matmul_s['jax']:.0f} ms, torch "
            f"{1e3 * matmul_s['torch']:.0f} ms; MFU of a step doing only these: JAX "
            f"{ceiling['jax']:.3f}, torch {ceiling['torch']:.3f}")  # fmt: skip
        ratios, checks = {}, []
        if "tfjax" in r["median_s"]:
            for c in r["contenders"]:
                if c == "tfjax":
                    continue
                ratios[f"tfjax/{c}"] = r["median_s"]["tfjax"] / r["median_s"][c]
                target = TARGETS[m].get(c)
                met = None if target is None else ratios[f"tfjax/{c}"] <= target
                if target is not None:
                    checks.append(dict(what=f"tfjax/{c}", value=ratios[f"tfjax/{c}"],
                                       target=f"<= {target}", met=met))  # fmt: skip
                note = "" if target is None else f"  (target <= {target}: "
                note += "" if target is None else ("met)" if met else "MISSED)")
                log(f"  ratio tfjax/{c} = {ratios[f'tfjax/{c}']:.3f}{note}")
            if m in MFU_TARGET:
                met = mfu["tfjax"] >= MFU_TARGET[m]
                checks.append(dict(what="tfjax MFU", value=mfu["tfjax"],
                                   target=f">= {MFU_TARGET[m]}", met=met))  # fmt: skip
                log(f"  tfjax MFU = {mfu['tfjax']:.3f}  (target >= {MFU_TARGET[m]}: "
                    f"{'met' if met else 'MISSED'})")  # fmt: skip
        for k in [k for k in r if k.endswith("_error")]:
            log(f"  {k[: -len('_error')]} did not run: {r[k][:300]}")
        if args.tiny:
            log("  (tiny sizes: a smoke run, targets do not apply)")
        summary[m] = dict(
            ratios=ratios,
            mfu=mfu,
            checks=checks,
            matmul_flops=matmul_flops,
            matmuls_alone_s=matmul_s,
            mfu_of_matmuls_alone=ceiling,
        )
    info["load_average_end"] = os.getloadavg()
    log(f"\nload average at end: {info['load_average_end']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(benchmark="train_step_vs_torch", tiny=args.tiny, machine=info,
                       roofline_flops=peak, roofline_source=peak_src,
                       roofline_before=peak_before, roofline_after=peak_after,
                       flops_convention="6*N*T + 12*L*T*S*D (tfjax.metrics), causal not "
                                        "discounted", results=results, summary=summary),
                  f, indent=1, default=float)  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
