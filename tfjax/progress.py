"""Progress of a long wait: a terminal bar while it runs, one summary line when it ends.

    bar = progress.bar(total=len(keys), unit="record", desc="SentencePiece: reading")
    ...; bar.update(); ...; bar.close()
    logging.info("read %s", progress.throughput(len(keys), "records", seconds))

The bar shows only on process 0 and only in a terminal: logs and notebooks would keep every
refresh as a line, so they get the `throughput` summary instead. Used by the data pipeline,
decoding and the runner alike, so it belongs to the library (it imports nothing of tfjax).
"""

from __future__ import annotations

import sys

import jax


def bar(*, total=None, unit="it", desc=None, initial=0, unit_scale=False):
    """A tqdm bar with its rate and ETA on process 0 in a terminal; elsewhere a disabled one
    with the same methods (update, write, close)."""
    import tqdm

    shown = jax.process_index() == 0 and sys.stderr.isatty()
    return tqdm.tqdm(
        total=total,
        initial=initial,
        unit=unit,
        desc=desc,
        unit_scale=unit_scale,
        dynamic_ncols=True,
        leave=False,
        disable=not shown,
    )


def throughput(count: float, unit: str, seconds: float) -> str:
    """ "12,288 tokens in 3.1 s (3,964 tokens/s)" """
    rate = f"{count / seconds:,.0f} {unit}/s" if seconds > 0 else "-"
    return f"{count:,.0f} {unit} in {seconds:.1f} s ({rate})"
