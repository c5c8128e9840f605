"""Checkpoints with Orbax (being split into modules by concern: see the next commit)."""

from tfjax.runner.checkpoint.restoring import *  # noqa: F403
