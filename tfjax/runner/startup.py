"""What the entry points (experiments/*.py) set up before any work: the platform JAX computes
on, and a console that shows tfjax's INFO lines without those of the libraries it calls.

    from tfjax.runner import startup      # imports no JAX
    startup.choose_platform()              # before anything imports JAX
    ...                                    # flags parsed
    startup.show_own_info_only()
"""

from __future__ import annotations

import functools
import logging as std_logging
import os
import sys

from absl import logging

from tfjax.runner import host_memory


def choose_platform() -> None:
    """JAX_PLATFORMS=cpu where the user set none and no accelerator is attached.

    JAX reads JAX_PLATFORMS once, when it is imported, so this must come first. Left unset on
    a CPU host, JAX would first try every installed plugin (libtpu and the CUDA plugin, which
    `make install-dev` installs to compile for TPUs and GPUs ahead of time) and print each one's
    failure to start. A GPU or TPU host keeps JAX's own choice: its accelerator.
    """
    if not host_memory.accelerator_attached():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def show_own_info_only() -> None:
    """Below WARNING, only the lines that tfjax's modules and the entry point itself log: Orbax
    logs an INFO line for every file it reads or writes. --verbosity=1 (or more) shows all."""
    if logging.get_verbosity() <= logging.INFO:
        logging.get_absl_handler().addFilter(_OwnInfoOnly())


class _OwnInfoOnly(std_logging.Filter):
    def filter(self, record):
        if record.levelno >= std_logging.WARNING:
            return True
        module = _module_name(record.pathname)
        return module == "__main__" or module.partition(".")[0] == "tfjax"


@functools.cache
def _module_name(pathname: str) -> str:
    """The name of the loaded module whose source is `pathname` ("" for none). By name, not by
    path: a checkout named tfjax holds the virtual environment, Orbax's files included."""
    # A copy, taken at once: a thread importing a module while this loop runs (Orbax's finalize
    # thread logs as it deletes a step) would change the dict under the loop.
    for name, module in sys.modules.copy().items():
        if getattr(module, "__file__", None) == pathname:
            return name
    return ""
