r"""The train-step contenders of train_step_vs_torch.py and host_memory.py: the models, their
batches and one training step of each library, each run in its own process by
`harness.time_processes` (this file is that process: `command()` builds its command line).

One training step = forward, backward and an AdamW update (lr 1e-4, weight decay 0.01, no
clipping, no dropout), float32, on one fixed batch already in memory, for:

  decoder  GPT-like decoder: d=512, 8 heads, 6 layers, F=2048, V=8192, T=256, batch 4
  vit      ViT-S/16 at 224 px, 1000 classes, class token, learned positions, batch 8
  gpt2     GPT-2 small (124M; V=50257, tied output), T=128, batch 4

Contenders, the same shapes and init scale (normal 0.02 for the language models):
  tfjax          tfjax.models.{decoder,vit} from a config (configs/{lm,vit}.py with these
                 sizes), its train step, tfjax.runner.optim's AdamW and donation from
                 tfjax.runner.setup.set_up, as the runner builds them
  stock_flax     the same network from flax.linen's nn.Embed / nn.Dense / nn.LayerNorm /
                 nn.MultiHeadDotProductAttention / nn.Conv, optax.adamw, jitted with donation
  torch_eager    Hugging Face GPT2LMHeadModel / ViTForImageClassification from a config (random
                 weights, SDPA attention), torch.optim.AdamW (foreach)
  torch_compile  the same torch module through torch.compile (inductor); the optimizer eager

Only the contender's own library is imported in its process.
"""

import argparse
import os
import sys

import harness

CONTENDERS = ("tfjax", "stock_flax", "torch_eager", "torch_compile")
# kind "lm": a GPT-2-style decoder (learned positions, pre-LN, tanh-GELU, tied output);
# kind "vit": ViT with a class token and learned positions, exact GELU, LayerNorm eps 1e-6.
SIZES = {
    "lm": ("width", "layers", "heads", "mlp", "vocab", "length", "max_len", "batch"),
    "vit": ("width", "layers", "heads", "mlp", "image", "patch", "classes", "batch"),
}


def _spec(kind: str, *sizes: int) -> dict:
    return dict(kind=kind, **dict(zip(SIZES[kind], sizes, strict=True)))


# fmt: off
MODELS = {  # one row per model, its sizes in SIZES[kind]'s order
    "decoder": _spec("lm",  512,  6,  8, 2048,  8192,  256,  256, 4),
    "vit":     _spec("vit", 384, 12,  6, 1536,   224,   16, 1000, 8),
    "gpt2":    _spec("lm",  768, 12, 12, 3072, 50257,  128, 1024, 4),
}
TINY = {
    "decoder": _spec("lm",  32, 2, 4, 128, 256, 16, 16, 2),
    "vit":     _spec("vit", 32, 2, 4,  64,  32, 16, 10, 2),
    "gpt2":    _spec("lm",  48, 2, 4, 192, 512, 16, 32, 2),
}
# fmt: on

LR, WEIGHT_DECAY = 1e-4, 0.01


# ------------------------------------------------------------------------------------- data
def make_batch(spec, seed=0):
    """numpy batch: lm {"tokens" [B, T] in [1, V), "weights" [B, T] ones}; vit {"image"
    [B, H, W, 3], "label" [B]}."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if spec["kind"] == "lm":
        tokens = rng.integers(1, spec["vocab"], (spec["batch"], spec["length"]), dtype=np.int32)
        return {"tokens": tokens, "weights": np.ones(tokens.shape, np.float32)}
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
    from tfjax.runner import defaults, setup

    if spec["kind"] == "lm":
        config = setup.load_config(os.path.join(harness.ROOT, "configs/lm.py") + ":tiny")
        model = dict(
            variant="gpt2-small",
            vocab_size=spec["vocab"],
            width=spec["width"],
            num_layers=spec["layers"],
            num_heads=spec["heads"],
            mlp_dim=spec["mlp"],
            max_len=spec["max_len"],
            dropout_rate=0.0,
        )
    else:
        config = setup.load_config(os.path.join(harness.ROOT, "configs/vit.py") + ":tiny")
        model = dict(
            variant=f"S/{spec['patch']}",
            num_classes=spec["classes"],
            width=spec["width"],
            num_layers=spec["layers"],
            num_heads=spec["heads"],
            mlp_dim=spec["mlp"],
            pool="cls",
            posemb="learned",
            dropout_rate=0.0,
            head_zero_init=False,
        )
    with config.unlocked():  # head_zero_init is not a field of configs/vit.py
        config.model.update(model, **model_overrides)
        config.update(
            batch_size=spec["batch"],
            eval_batch_size=spec["batch"],
            num_train_steps=10**6,
            dtype="float32",
        )
        config.loss.update(label_smoothing=0.0, z_loss=0.0)
        config.optim = defaults.optim(
            learning_rate=LR,
            schedule="constant",
            warmup_steps=0,
            end_learning_rate_fraction=1.0,
            weight_decay=WEIGHT_DECAY,
            grad_clip_norm=0.0,
        )
        config.mesh.update(data=-1, fsdp=1, tensor=1)
    return config


def tfjax_inputs(spec):
    """setup.Inputs of make_batch(spec)'s batches (their shapes and dtypes)."""
    import jax
    import numpy as np

    from tfjax.runner import setup

    def sds(*shape, dtype):
        return jax.ShapeDtypeStruct((spec["batch"], *shape), dtype)

    if spec["kind"] == "lm":
        batch = {
            "tokens": sds(spec["length"], dtype=np.int32),
            "weights": sds(spec["length"], dtype=np.float32),
        }
        return setup.Inputs(train=batch, eval=batch, vocab_size=spec["vocab"])
    s = spec["image"]
    batch = {"image": sds(s, s, 3, dtype=np.float32), "label": sds(dtype=np.int32)}
    return setup.Inputs(train=batch, eval=batch, num_classes=spec["classes"])


def set_up_tfjax(spec, **model_overrides):
    """tfjax.runner.setup.set_up of tfjax_config(spec) on one device."""
    import jax

    from tfjax import sharding
    from tfjax.runner import setup

    config = tfjax_config(spec, **model_overrides)
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    return setup.set_up(config, mesh, inputs=tfjax_inputs(spec))


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
        model = gpt(*map(spec.get, ("vocab", "width", "layers", "heads", "mlp", "max_len")))

        def loss_fn(params, batch):
            logits = model.apply({"params": params}, batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], batch["tokens"][:, 1:]
            ).mean()

        x = batch_np["tokens"]
    else:
        model = vit_cls(*map(spec.get, ("classes", "patch", "width", "layers", "heads", "mlp")))

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
            vocab_size=spec["vocab"],
            n_positions=spec["max_len"],
            n_embd=spec["width"],
            n_layer=spec["layers"],
            n_head=spec["heads"],
            n_inner=spec["mlp"],
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
            initializer_range=0.02,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            loss_type="ForCausalLM",
        )
        model = transformers.GPT2LMHeadModel(config)
        inputs = torch.from_numpy(batch_np["tokens"]).long()

        def loss_of(m):
            return m(input_ids=inputs, labels=inputs, use_cache=False).loss

    else:
        config = transformers.ViTConfig(
            hidden_size=spec["width"],
            num_hidden_layers=spec["layers"],
            num_attention_heads=spec["heads"],
            intermediate_size=spec["mlp"],
            image_size=spec["image"],
            patch_size=spec["patch"],
            num_labels=spec["classes"],
            hidden_act="gelu",
            layer_norm_eps=1e-6,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            qkv_bias=True,
            initializer_range=0.02,
        )
        model = transformers.ViTForImageClassification(config)
        # [B, C, H, W]: torch's layout
        images = torch.from_numpy(batch_np["image"]).permute(0, 3, 1, 2).contiguous()
        labels = torch.from_numpy(batch_np["label"]).long()

        def loss_of(m):
            return F.cross_entropy(m(pixel_values=images).logits, labels)

    model.train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=LR,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=WEIGHT_DECAY,
        foreach=True,
    )

    stepped = torch.compile(model) if compiled else model

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(stepped)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, sum(p.numel() for p in model.parameters())


def build(contender, spec, batch_np):
    """(step() -> loss, info) for one contender; info holds its parameter count (and FLOPs)."""
    if contender == "tfjax":
        step, flops, n = build_tfjax(spec, batch_np)
        return step, {"flops": flops, "params_tfjax": n}
    if contender == "stock_flax":
        step, n = build_stock_flax(spec, batch_np)
        return step, {"params_stock_flax": n}
    step, n = build_torch(spec, batch_np, compiled=contender == "torch_compile")
    return step, {"params_torch": n}


def command(contender, model, *, warmup, threads, malloc, tiny):
    """The command line of a process that serves `contender`'s steps on `model`."""
    return [
        sys.executable,
        os.path.abspath(__file__),
        f"--contender={contender}",
        f"--model={model}",
        f"--warmup={warmup}",
        f"--threads={threads}",
        f"--malloc={malloc}",
        *(["--tiny"] if tiny else []),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contender", choices=CONTENDERS)
    parser.add_argument("--model", default="decoder")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--threads", type=int, default=0, help="cores to use (0: all)")
    parser.add_argument("--malloc", default="keep", choices=("keep", "glibc"))
    parser.add_argument("--tiny", action="store_true", help="toy sizes")
    args = parser.parse_args()
    if not args.contender:  # `make bench` runs every file here; this one is no benchmark
        print("contenders.py serves the steps of train_step_vs_torch.py and host_memory.py")
        return
    threads = harness.use_cores(args.threads)
    if args.malloc == "keep":  # every contender alike, before its library starts threads
        from tfjax.runner import host_memory

        host_memory.keep_freed_memory()
    if args.contender.startswith("torch"):
        import torch

        torch.set_num_threads(threads)
    else:
        import jax

        jax.config.update("jax_enable_compilation_cache", False)  # measure real compiles
    spec = (TINY if args.tiny else MODELS)[args.model]
    batch_np = make_batch(spec)
    harness.serve(lambda: build(args.contender, spec, batch_np), warmup=args.warmup)


if __name__ == "__main__":
    main()
