"""The experiment runner: what the entry points (experiments/), the benchmarks and the tests use.

    from tfjax.runner import setup, train
    config = setup.load_config("configs/vit.py:digits")     # as --config= does
    result = train.train_and_evaluate(config, "/tmp/vit")   # or experiments/run.py

  checks      the config's and paths' value checks, before any work starts
  setup       config + mesh -> model, abstract sharded state, jitted steps (`set_up`)
  steps       the pure train and eval step functions, TrainState
  train       the loop: restore, train, evaluate, log, save (`train_and_evaluate`,
              `restore_model`)
  evaluation  eval-split metrics and the task's decode-eval hook
  optim       Optax optimizer and schedule from config.optim
  checkpoint  Orbax checkpoints with checksums; resume, restore onto other meshes
  metrics     metrics.jsonl, TensorBoard, the console line
  plots       curves of a run, attention maps
  profiling   the profiler window of config.profile
  workdirs    who owns a workdir (the run lock), the config history
  preemption  stopping on SIGTERM / SIGINT after a saved step
  host_memory malloc settings for CPU runs
  startup     what the entry points set first: JAX's platform, which INFO lines show
  chips       accelerators as data, model FLOPs and MFU
  aot         compile a config for a TPU slice or GPU hosts from a CPU host
  executables the programs a run starts with, saved by compile.py --save, loaded at start-up
  distributed jax.distributed start-up with a deadline that names who is missing
  jax_internals  the one place that uses JAX's private modules

The library (`tfjax.nn`, `models`, `decode`, `sharding`, `interop`, `data`, `tasks`) never
imports this package.
"""

from tfjax import _lazy

__getattr__, __dir__ = _lazy.submodules(__name__, __path__, globals())
