"""Test set-up: 8 CPU devices for the sharding tests, before any JAX backend starts."""

import os

# Must happen before JAX initialises a backend; the flag works on every jax version we support.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

# libtpu is installed for the ahead-of-time compile tests; without a TPU attached, JAX must not
# try to start a TPU backend (slow, noisy): the suite computes on the CPU.
from tfjax import host_memory  # noqa: E402

if not host_memory.accelerator_attached():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def _has(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    for platform in ("gpu", "tpu"):
        if _has(platform):
            continue
        skip = pytest.mark.skip(reason=f"needs a {platform.upper()}; none on this machine")
        for item in items:
            if platform in item.keywords:
                item.add_marker(skip)


def set_fields(config, overrides: dict):
    """Sets {"optim.learning_rate": 0.1, ...} on a config, as --config.<key>= does; returns it."""
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        target = config
        for p in parents:
            target = target[p]
        target[leaf] = value
    return config
