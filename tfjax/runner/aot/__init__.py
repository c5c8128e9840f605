"""Compile an experiment for a TPU slice or GPU hosts from a CPU host (being split into modules)."""

from tfjax.runner.aot.hlo import *  # noqa: F403
from tfjax.runner.aot.hlo import _compile_step  # noqa: F401
