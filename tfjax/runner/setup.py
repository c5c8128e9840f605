"""From a config and a mesh to the model, the abstract sharded state and the jitted steps.

    from tfjax.runner import setup
    config = setup.load_config("configs/lm.py:tiny")              # as --config= does
    mesh = sharding.make_mesh(config.mesh)                        # or a topology's devices
    exp = setup.set_up(config, mesh, inputs=setup.planned_inputs(config))
    state = exp.init(jax.random.key(0))                           # created in its shards
    state, stats = exp.train_step(state, batch, rng)

This is the one place the recipe of a run lives: the loop (`tfjax.runner.train`), the
ahead-of-time compiler (`tfjax.runner.aot`, `experiments/compile.py`), the benchmarks and the
tests all call `set_up`. It needs no data, workdir or accelerator: the batch shapes and the
vocabulary come as `Inputs`, from the real loaders (`Inputs.from_loaders`) or planned from the
config alone (`planned_inputs`), and `mesh` may hold the compile-only devices of a TPU or GPU
topology.

The state is created shape-first: `jax.eval_shape` of the initialiser gives the shapes and
logical names, the rules turn those into shardings, and `exp.init` (jitted with those
out_shardings) creates every parameter directly in its shards, so no device ever holds a full
copy of a sharded model. `exp.train_step` donates the state it is given.

The model is a Linen family model (tfjax.models); with config.model.api="nnx" the steps call
its NNX form (tfjax.nnx) through Linen's init and apply (`for_api`): the same parameters,
state and checkpoints, so a run may resume in either API.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import os
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from flax import traverse_util

from tfjax import lora as lora_lib
from tfjax import sharding, tasks
from tfjax.nnx.functional import Functional
from tfjax.runner import checkpoint, checks, chips, defaults, evaluation, optim
from tfjax.runner import pretrained as pretrained_lib
from tfjax.runner.steps import TrainState, make_eval_step, make_train_step, split_params

VOCAB_MULTIPLE = 128  # a vocabulary taken from the tokenizer is padded to a multiple of this


# ----------------------------------------------------------------------------------- configs
def load_config(spec: str) -> ml_collections.ConfigDict:
    """Loads "configs/vit.py:digits,tiny" as --config= does: get_config("digits,tiny")."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_tfjax_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


# ------------------------------------------------------------------------------------ inputs
@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the model and the steps need to know of the data: global batch shapes and sizes.

    train, eval: {key: jax.ShapeDtypeStruct} of one global batch (config.batch_size and
      config.eval_batch_size rows).
    vocab_size: the tokenizer's ids (None for images); the model pads it to VOCAB_MULTIPLE.
    num_classes: the dataset's labels (None for text without labels).
    """

    train: dict[str, jax.ShapeDtypeStruct]
    eval: dict[str, jax.ShapeDtypeStruct]
    vocab_size: int | None = None
    num_classes: int | None = None

    @classmethod
    def from_loaders(cls, config, data, train_loader, eval_loader) -> Inputs:
        """The inputs of real loaders (per-process batches scaled to the global batch) of the
        dataset `data` (a tfjax.data.DatasetSpec)."""

        def global_spec(loader, rows):
            return {
                k: jax.ShapeDtypeStruct((rows, *s.shape[1:]), s.dtype)
                for k, s in loader.element_spec.items()
            }

        tokenizer = train_loader.tokenizer
        return cls(
            train=global_spec(train_loader, config.batch_size),
            eval=global_spec(eval_loader, config.eval_batch_size),
            vocab_size=tokenizer.vocab_size if tokenizer is not None else None,
            num_classes=data.num_classes,
        )


def planned_inputs(config, data=None) -> Inputs:
    """The inputs a run of `config` will have, from the config alone: no data is read and no
    tokenizer trained (for compiling ahead of time and for restoring a model).

    The vocabulary is config.model.vocab_size when set; else 261 for bytes and the dataset's
    SentencePiece vocab_size (an upper bound of what training the tokenizer gives) otherwise;
    for the user's files (a checkpoint's tokenizer) the model's own (its checkpoint or variant).
    `data` is the run's tfjax.data.DatasetSpec, resolved from the config when None.
    """
    import tfjax.data

    data = data or tfjax.data.dataset_spec(config)
    vocab_size = None
    if not data.images and not tfjax.data.catalog.is_files(data.name):  # files: the model's
        vocab_size = config.model.get("vocab_size") or (
            tfjax.data.ByteTokenizer.vocab_size if data.tokenizer == "bytes" else data.vocab_size
        )
    return Inputs(
        train=tfjax.data.element_spec(data, config.batch_size),
        eval=tfjax.data.element_spec(data, config.eval_batch_size),
        vocab_size=vocab_size,
        num_classes=data.num_classes,
    )


# ------------------------------------------------------------------------------------- model
def build_model(
    config,
    *,
    vocab_size: int | None = None,
    num_classes: int | None = None,
    pretrained: pretrained_lib.Pretrained | None = None,
):
    """tfjax.models.<config.model.name>.Model(**config.model without name), compute dtype from
    config.dtype. Fields that are None take the model's default, except vocab_size (the
    tokenizer's, padded to a multiple of VOCAB_MULTIPLE) and num_classes (the dataset's).
    From a `pretrained` checkpoint: its model, with what config.model may set on it
    (`tfjax.runner.pretrained.model_fields`), and its vocabulary as it is; a vision tower gets
    a new head of num_classes (`tfjax.runner.pretrained.with_head`)."""
    if pretrained is not None:
        fields = pretrained_lib.model_fields(pretrained, config.model)
        fields = pretrained_lib.with_head(pretrained, fields, num_classes)
        if vocab_size is not None and vocab_size > fields["vocab_size"]:
            raise ValueError(
                f"the tokenizer has {vocab_size} ids, more than the {fields['vocab_size']} "
                f"embedding rows of the checkpoint in config.init_from={pretrained.config_dir!r}"
            )
        if config.dtype != "float32":
            fields["dtype"] = checks.COMPUTE_DTYPES[config.dtype]
        return _family_model(defaults.model_module(pretrained.model_name), fields)
    fields = dict(config.model)
    fields.pop("api", None)  # which API runs the model (`for_api`), not a field of it
    module = defaults.model_module(fields.pop("name"))
    if fields.get("vocab_size") is None and vocab_size is not None:
        # Rounded up so that the vocab axis shards evenly over any tensor-parallel size up to
        # 128 (and matmuls tile well); the extra ids never occur, their logits learn to be low.
        fields["vocab_size"] = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif vocab_size is not None and fields["vocab_size"] < vocab_size:
        raise ValueError(
            f"model.vocab_size={fields['vocab_size']} is smaller than the tokenizer's "
            f"{vocab_size} ids"
        )
    if "num_classes" in fields and fields["num_classes"] is None:
        fields["num_classes"] = num_classes
    fields = {k: v for k, v in fields.items() if v is not None}
    if config.dtype != "float32":
        fields["dtype"] = checks.COMPUTE_DTYPES[config.dtype]
    return _family_model(module, fields)


def api(config) -> str:
    """config.model.api: "linen" or "nnx" ("linen" for configs recorded before the field)."""
    return config.model.get("api", "linen")


def for_api(config, model, task, element_spec, lora=None):
    """`model` (a Linen family model, as `build_model` gives it) as config.model.api runs it:
    itself ("linen"), or its NNX model behind Linen's init and apply ("nnx":
    `tfjax.nnx.functional.Functional`, which the steps and decoding take as they take the Linen
    model), sized by a batch of `element_spec` as Linen's init is (a ViT's images), with the
    adapters of `lora` (a tfjax.lora.LoraConfig) as the NNX LoRA provider adds them. Both have
    the same parameter tree, so the state and the checkpoints are the same."""
    if api(config) == "linen":
        return model
    args, kwargs = task.model_inputs(dummy_batch(element_spec, 1))
    adapt = None
    if lora is not None:  # the adapters (QLoRA: the targeted kernels quantized)

        def adapt(nnx_model, rngs):
            return lora_lib.apply_lora(nnx_model, lora, *args, **kwargs, train=False, rngs=rngs)

    try:
        return Functional(model, *args, adapt=adapt)
    except NotImplementedError as e:  # a family or layer tfjax.nnx does not have yet
        raise ValueError(f"model.api='nnx': {e}; model.api='linen' runs it") from None


def _family_model(module, fields: dict):
    """module.Model(**fields), its errors naming the config's fields: the family checks its
    own ("VisionTransformer.width must be ..."), which the config calls "model.width"."""
    try:
        return module.Model(**fields)
    except ValueError as e:
        family = module.Model.__annotations__["return"].__name__
        raise ValueError(str(e).replace(f"{family}.", "model.")) from None


def dummy_batch(element_spec: dict, rows: int) -> dict:
    """Zeros shaped like a batch of `rows` rows (for shapes and names at initialisation)."""
    return {k: jnp.zeros((rows, *s.shape[1:]), s.dtype) for k, s in element_spec.items()}


def _example_inputs(task, element_spec, mesh, rules):
    """(args, kwargs) of the model on the smallest dummy batch that shards evenly (call it
    inside the traced function, under the logical axis rules)."""
    rows = sharding.data_parallel_size(mesh, rules)
    return task.model_inputs(dummy_batch(element_spec, rows))


def _init_variables_fn(model, task, element_spec, *, mesh, rules):
    def init_variables(rng):
        with sharding.logical_context(mesh, rules):
            args, kwargs = _example_inputs(task, element_spec, mesh, rules)
            return model.init({"params": rng}, *args, **kwargs, train=False)

    return init_variables


def abstract_params(model, task, element_spec, *, mesh, rules):
    """(abstract parameters with their shardings, the shardings), without allocating."""
    init_variables = _init_variables_fn(model, task, element_spec, mesh=mesh, rules=rules)
    boxed = jax.eval_shape(init_variables, jax.random.key(0))["params"]
    param_shardings = sharding.logical_shardings(boxed, mesh, rules)
    params = nn.unbox(boxed)
    sharding.check_divisible(params, param_shardings)
    return checkpoint.abstract_like(params, param_shardings), param_shardings


def quantize_base_fn(exp: Experiment):
    """QLoRA (lora.base_dtype): (the base model's abstract float params with their shardings,
    fn(float params, rng) -> the LoRA model's params, jitted onto their shardings): the
    adapters made and the targeted kernels quantized by the model itself
    (`tfjax.lora.init_params`), from float weights loaded into the first."""
    abstract, _ = abstract_params(
        exp.base_model, exp.task, exp.inputs.train, mesh=exp.mesh, rules=exp.rules
    )

    # The Linen LoRA model quantizes for both APIs (the same kernels, bit for bit): an NNX
    # model's Functional applies parameters, it does not make them from given ones.
    linen = exp.model.spec if isinstance(exp.model, Functional) else exp.model

    def quantize(params, rng):
        with sharding.logical_context(exp.mesh, exp.rules):
            args, kwargs = _example_inputs(exp.task, exp.inputs.train, exp.mesh, exp.rules)
            return lora_lib.init_params(linen, params, rng, *args, **kwargs, train=False)

    return abstract, jax.jit(quantize, out_shardings=exp.param_shardings, donate_argnums=0)


def abstract_train_state(model, tx, task, element_spec, *, mesh, rules, ema: bool, trainable=None):
    """(init_fn, abstract TrainState with shardings, param shardings), without allocating.

    init_fn(rng) creates the state; jit it with out_shardings=the abstract state's shardings.
    init_fn(rng, known) takes the parameters `known` gives (a tree of the params' paths, None
    where a parameter is to be initialised: a checkpoint's weights beside new adapters or a new
    head) instead of initialising them: their random values are dead code the compiler drops,
    so a run from a checkpoint never holds a random copy of what it loads. The optimizer state
    is made from the boxed parameters, so Adam's moments (and the EMA) carry the parameters'
    logical names through `tx.init` and shard as they do; what has no name (step counts) is
    replicated. With `trainable` (see steps.make_train_step) it holds
    the moments of the trainable parameters only.
    """
    init_variables = _init_variables_fn(model, task, element_spec, mesh=mesh, rules=rules)

    def boxed_state(rng):
        params = init_variables(rng)["params"]  # nn.LogicallyPartitioned leaves
        zero = jnp.zeros((), jnp.int32)
        return TrainState(
            step=zero,
            params=params,
            opt_state=tx.init(params if trainable is None else split_params(params, trainable)[0]),
            ema_params=params if ema else None,
            skipped=zero,
            skipped_in_a_row=zero,
        )

    boxed = jax.eval_shape(boxed_state, jax.random.key(0))
    shardings = sharding.logical_shardings(boxed, mesh, rules)
    abstract = nn.unbox(boxed)
    sharding.check_divisible(abstract.params, shardings.params)

    def init_fn(rng, known=None):
        state = nn.unbox(boxed_state(rng))  # the moments depend on the params' shapes only
        if known is None:
            return state
        flat = traverse_util.flatten_dict(state.params)
        for path, value in traverse_util.flatten_dict(known).items():
            if value is not None:
                flat[path] = value
        params = traverse_util.unflatten_dict(flat)
        return state.replace(params=params, ema_params=params if ema else None)

    return init_fn, checkpoint.abstract_like(abstract, shardings), shardings.params


# ------------------------------------------------------------------------------------ set-up
@dataclasses.dataclass(frozen=True)
class Experiment:
    """Everything `set_up` builds; no array is allocated until `init` is called.

    The jitted steps (one signature each, so each compiles once):
      init(rng, known=None) -> TrainState          created directly in its shards (`known`:
                                                   parameters given, donated; see
                                                   abstract_train_state)
      train_step(state, batch, rng) -> (state, stats)   donates `state`
      eval_step(params, batch) -> stats
    `train_batch` / `eval_batch` are the global batches' ShapeDtypeStructs with their
    shardings, `abstract_state` the TrainState's: together they lower every step without data
    (`exp.train_step.lower(exp.abstract_state, exp.train_batch, exp.abstract_rng)`).
    """

    config: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    rules: tuple
    task: Any  # the tfjax.tasks module
    model: Any  # the Linen model, or its `for_api` Functional with model.api="nnx"
    tx: optax.GradientTransformation
    schedule: Callable[[int], Any]
    inputs: Inputs
    abstract_state: TrainState  # ShapeDtypeStructs with shardings
    param_shardings: Any
    train_batch: dict[str, jax.ShapeDtypeStruct]
    eval_batch: dict[str, jax.ShapeDtypeStruct]
    init: Callable
    train_step: Callable
    eval_step: Callable
    flops_per_step: float  # model FLOPs of one train step (tfjax.runner.chips' count)
    pretrained: pretrained_lib.Pretrained | None = None  # the checkpoint the run starts from
    base_model: nn.Module | None = None  # with LoRA: `model` without its adapters
    lora: Any = None  # with LoRA: its tfjax.lora.LoraConfig (the run's `Run.lora`)

    @property
    def state_shardings(self):
        return jax.tree.map(lambda a: a.sharding, self.abstract_state)

    @property
    def replicated(self) -> jax.sharding.NamedSharding:
        return sharding.replicated(self.mesh)

    @property
    def abstract_rng(self) -> jax.ShapeDtypeStruct:
        """The dropout key argument of train_step, replicated."""
        key = jax.eval_shape(lambda: jax.random.key(0))
        return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=self.replicated)

    @property
    def num_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_state.params))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """A config checked and worked out once (`resolve`), before JAX starts a backend and before
    any data, model or workdir work: what the checks, set-up, restore, decoding and export read,
    so none of them works it out again."""

    config: ml_collections.ConfigDict
    workdir: str | None  # absolute; None where a run has none (compiling, benchmarks)
    rules: tuple  # config.logical_axis_rules, checked
    task: Any  # the tfjax.tasks module of config.task
    pretrained: pretrained_lib.Pretrained | None = None  # the checkpoint of config.init_from
    lora: Any = None  # the tfjax.lora.LoraConfig of config.lora; None without adapters

    @functools.cached_property
    def data(self):
        """The run's tfjax.data.DatasetSpec with what the checkpoint gives it
        (`tfjax.runner.pretrained.dataset_spec`): worked out when first read, once (a compile
        from the config alone never reads it, so needs none of the dataset's files)."""
        return pretrained_lib.dataset_spec(self.config, self.workdir)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared(Run):
    """A Run on the mesh it runs on, its batch sizes checked against it (`prepare`)."""

    mesh: jax.sharding.Mesh


def resolve(config, workdir=None, *, restore=False) -> Run:
    """Every check of a run's config and paths, once, before any work and before JAX starts a
    backend: the config's values, the paths (with a workdir; restore=True: it must hold a
    checkpoint, and init_from is not read), the sharding rules, the checkpoint of
    config.init_from (a size set differently is refused) and the LoRA config. Each error names
    the field or flag and what is allowed."""
    rules = checks.check_config(config)
    if workdir is not None:
        checks.check_paths(config, workdir, restore=restore, files=False)
        workdir = os.path.abspath(os.path.expanduser(workdir))
    pretrained = pretrained_lib.find(config, workdir)
    if pretrained is not None:  # its refusals (a size set differently) before any work
        pretrained_lib.model_fields(pretrained, config.model)
    run = Run(
        config=config,
        workdir=workdir,
        rules=rules,
        task=tasks.get(config.task),
        pretrained=pretrained,
        lora=optim.lora_config(config),
    )
    if workdir is not None and not restore:  # the dataset's own files
        checks.check_data(config, run.data)
    return run


def prepare(config, workdir=None, devices=None, *, mesh=None, restore=False, run=None) -> Prepared:
    """`run` (the config resolved: `resolve(config, workdir, restore=restore)` when None) on a
    mesh: a new one over `devices` (all of them by default) unless `mesh` is given, with the
    batch sizes checked against it (not with restore=True, which builds no steps). What the
    devices cannot honour is a ConfigError naming the field, before any work."""
    run = run or resolve(config, workdir, restore=restore)
    try:  # what the fields ask of the devices: found once JAX has them, before any work
        mesh = sharding.make_mesh(config.mesh, devices) if mesh is None else mesh
        if not restore:
            checks.check_batch(
                "batch_size", config.batch_size, mesh, run.rules, config.num_microbatches
            )
            checks.check_batch("eval_batch_size", config.eval_batch_size, mesh, run.rules)
    except ValueError as e:
        raise checks.ConfigError(str(e)) from None
    fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(Run)}
    prepared = Prepared(**fields, mesh=mesh)
    if "data" in run.__dict__:  # worked out already: kept, not worked out again
        prepared.__dict__["data"] = run.data
    return prepared


def check_run(config, workdir: str) -> Run:
    """Every check of a training run, before any data, model or workdir work and before JAX
    starts a backend (experiments/run.py makes it first): the config and paths resolved
    (`resolve`), then the model built abstractly on the batches the run will have
    (`check_model`). Returns the Run, for `tfjax.runner.train.train_and_evaluate`."""
    run = resolve(config, workdir)
    check_model(run)
    return run


def check_model(run: Run) -> None:
    """The model of `config` built as the run will build it, abstractly: its family checks
    every field (`tfjax.models.common.check_fields`), one trace of its initialisation on a row
    of the planned batches checks what relates it to the data (image and patch sizes, lengths
    and the position table, LoRA targets, optim.freeze), and a classifier's head must have a
    logit for every class of the dataset. No array is made and no backend started: the trace
    asks for the "xla" attention (the same parameters), whose choice needs no device."""
    config, data, lora = run.config, run.data, run.lora
    inputs = planned_inputs(config, data)
    vocab_size = inputs.vocab_size
    if vocab_size is None and not data.images:  # the user's files: their tokenizer's ids must
        from tfjax.data import files  # fit the model's embedding rows (a checkpoint's own)

        vocab_size = files.load_tokenizer(data.tokenizer, files.tokenizer_field(config)).vocab_size
    model = build_model(
        config, vocab_size=vocab_size, num_classes=inputs.num_classes, pretrained=run.pretrained
    ).clone(implementation="xla")
    evaluation.check_decode(config, model, inputs.eval)  # the eval samples' prompts and room
    if lora is not None:  # its targets; QLoRA's quantized matmuls would ask for the device
        floats = dataclasses.replace(lora, base_dtype=None, tile_size=None)
        model = lora_lib.apply_lora(model, floats)
    task = run.task

    def init():
        args, kwargs = task.model_inputs(dummy_batch(inputs.train, 1))
        return model.init_with_output(jax.random.key(0), *args, **kwargs, train=False)

    try:
        (output, _), variables = jax.eval_shape(init)
    except (ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if first.startswith("LoraConfig."):  # its targets match no kernel: config.lora's
            raise ValueError(first.replace("LoraConfig.", "lora.", 1)) from None
        rows = {k: (1, *s.shape[1:]) for k, s in inputs.train.items()}
        raise ValueError(
            f"model.name={config.model.name!r} cannot take the batches of dataset "
            f"{data.name!r} ({rows}): {first}"
        ) from e
    if lora is not None:  # QLoRA's blocks against every adapted kernel's width
        lora_lib.check_tile_size(lora, variables["params"], "lora")
    trainable = optim.trainable(config.optim, lora=lora is not None)
    if trainable is not None:
        optim.check_trainable(config.optim, nn.unbox(variables["params"]), trainable)
    for_api(config, model, task, inputs.train, lora)  # what tfjax.nnx cannot run, by name
    if config.task == "classification" and data.num_classes:
        head = output.shape[-1]
        if head < data.num_classes:
            raise ValueError(
                f"model.num_classes={head} is fewer than dataset.num_classes="
                f"{data.num_classes} (dataset {data.name!r}): its labels from {head} on would "
                f"have no logit; leave model.num_classes unset (the dataset's) or make it at "
                f"least {data.num_classes}"
            )


def set_up(config, mesh, *, inputs: Inputs) -> Experiment:
    """The model, optimizer, abstract sharded state and jitted steps of `config` on `mesh`:
    `build(prepare(config, mesh=mesh), inputs)`. `mesh` may hold real devices or a topology's
    compile-only devices."""
    return build(prepare(config, mesh=mesh), inputs)


def build(prepared: Prepared, inputs: Inputs) -> Experiment:
    """The model, optimizer, abstract sharded state and jitted steps of a prepared config, for
    batches shaped as `inputs` (checked against config.loss.chunks here: they may be the real
    loaders')."""
    config, mesh, rules, task = prepared.config, prepared.mesh, prepared.rules, prepared.task
    chunks = checks.loss_chunks(config)
    if chunks > 1:  # the lengths of the batches the steps will get (`inputs` may not be planned)
        lengths = {
            f"the {split} batches' labels": jax.eval_shape(task.labels_and_weights, spec)[0].shape[
                1
            ]
            for split, spec in (("train", inputs.train), ("eval", inputs.eval))
        }
        checks.check_loss_chunks(config, lengths)
    model = build_model(
        config,
        vocab_size=inputs.vocab_size,
        num_classes=inputs.num_classes,
        pretrained=prepared.pretrained,
    )
    schedule = optim.make_schedule(
        config.optim, d_model=model.width, num_train_steps=config.num_train_steps
    )
    tx = optim.make_optimizer(
        config.optim, d_model=model.width, num_train_steps=config.num_train_steps
    )
    base_model, lora_config = model, prepared.lora
    if lora_config is not None:
        model = lora_lib.apply_lora(model, lora_config)
    runs = for_api(config, model, task, inputs.train, lora_config)  # what the steps call
    ema = config.optim.ema_decay > 0
    trainable = optim.trainable(config.optim, lora=lora_config is not None)
    init_fn, abstract_state, param_shardings = abstract_train_state(
        runs, tx, task, inputs.train, mesh=mesh, rules=rules, ema=ema, trainable=trainable
    )
    if trainable is not None:
        trained = optim.check_trainable(config.optim, abstract_state.params, trainable)
        logging.info("Training %d of %d parameter arrays", *trained)
    state_shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
    repl = sharding.replicated(mesh)

    def batch_of(spec):
        return {
            k: jax.ShapeDtypeStruct(
                s.shape, s.dtype, sharding=sharding.batch_sharding(mesh, rules, len(s.shape))
            )
            for k, s in spec.items()
        }

    train_batch, eval_batch = batch_of(inputs.train), batch_of(inputs.eval)
    train_step = jax.jit(
        make_train_step(
            runs,
            task,
            tx,
            mesh=mesh,
            rules=rules,
            num_microbatches=config.num_microbatches,
            label_smoothing=config.loss.label_smoothing,
            z_loss=config.loss.z_loss,
            ema_decay=config.optim.ema_decay,
            loss_chunks=chunks,
            trainable=trainable,
        ),
        in_shardings=(state_shardings, {k: s.sharding for k, s in train_batch.items()}, repl),
        out_shardings=(state_shardings, repl),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        make_eval_step(runs, task, mesh=mesh, rules=rules, loss_chunks=chunks),
        in_shardings=(param_shardings, {k: s.sharding for k, s in eval_batch.items()}),
        out_shardings=repl,
    )
    example = {k: s.shape for k, s in inputs.train.items()}
    flops = config.batch_size * chips.training_flops_per_example(
        model, abstract_state.params, example
    )
    return Experiment(
        config=config,
        mesh=mesh,
        rules=rules,
        task=task,
        model=runs,
        tx=tx,
        schedule=schedule,
        inputs=inputs,
        abstract_state=abstract_state,
        param_shardings=param_shardings,
        train_batch=train_batch,
        eval_batch=eval_batch,
        init=jax.jit(init_fn, out_shardings=state_shardings, donate_argnums=1),
        train_step=train_step,
        eval_step=eval_step,
        flops_per_step=flops,
        pretrained=prepared.pretrained,
        base_model=base_model if lora_config is not None else None,
        lora=lora_config,
    )
