"""What each family converts, and how `interop.load` and `interop.export` find it.

Every family module ends with what it converts, row by row of the table of what converts
(docs/interop.md, from `interop.supported()`):

    CONVERTS = registry.Converts(
        rows=(
            registry.Row(
                "GPT-2", "`from_gpt2` / `to_gpt2`", "decoder", "(learned positions)",
                loads={"GPT2LMHeadModel": from_gpt2},  # config.json's architecture -> loader
            ),
        ),
        exports=(registry.Exporter(decoder.Decoder, when=_is_gpt2, export=to_gpt2, ...),),
    )

A loader is called as `loader(directory, config, **overrides)`; a row that loads no
architecture converts torch modules and their state dicts (torch.nn). An exporter takes the
tfjax models of its class for which `when(model)` holds; the exporters of one class exclude each
other, so the order of families does not matter, and a model two of them take is a bug that
`Registry.exporter` reports. `families` builds the one `Registry` of every family's `Converts`
(`interop.REGISTRY`); families never import each other.
"""

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Exporter:
    """How a family writes the tfjax models of one class that `when` accepts."""

    model: type  # the tfjax model class (decoder.Decoder)
    when: Callable[[Any], bool]  # model -> whether this exporter writes it
    export: Callable  # (model, params) -> ({Hugging Face key: numpy array}, config dict)
    family: Callable  # model -> the tables.Family (the config table) the export writes
    needs: str  # what `when` asks, in words: a model no exporter takes is refused with these


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the table of what converts (docs/interop.md) as the docs show it, and the
    loaders of its architectures: the table is this code, so the two cannot disagree."""

    source: str  # what converts, in words: "GPT-2"
    converters: str  # the `tfjax.interop` functions that convert it: "`from_gpt2` / `to_gpt2`"
    model: str  # the tfjax model it converts to: "decoder" (tfjax.models.decoder)
    notes: str  # what the conversion sets or reads: "(learned positions)"
    # config.json's architecture -> loader(directory, config, **overrides); none: the row
    # converts torch modules and their state dicts (torch.nn), which `interop.load` does not
    loads: Mapping[str, Callable] = dataclasses.field(default_factory=dict)

    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(self.loads)

    @property
    def cells(self) -> tuple[str, str, str, str]:
        """(architectures, source, converters, tfjax model): the row's cells in the docs."""
        named = ", ".join(f"`{a}`" for a in self.loads)
        return named, self.source, self.converters, f"`{self.model}` {self.notes}"


@dataclasses.dataclass(frozen=True)
class Converts:
    """What one family module loads (its rows, by architecture) and exports (by model)."""

    rows: tuple[Row, ...] = ()
    exports: tuple[Exporter, ...] = ()

    @property
    def loads(self) -> dict[str, Callable]:
        """Every row's loaders by architecture."""
        return {a: loader for row in self.rows for a, loader in row.loads.items()}


class Registry:
    """Every family's loaders by architecture, and their exporters."""

    def __init__(self, converts: Iterable[Converts]):
        self.loaders: dict[str, Callable] = {}
        self.exporters: list[Exporter] = []
        self.rows: list[Row] = []  # the table of what converts, in the families' order
        for c in converts:
            for row in c.rows:
                for architecture, loader in row.loads.items():
                    if architecture in self.loaders:
                        raise ValueError(f"two loaders for {architecture}")
                    self.loaders[architecture] = loader
            self.rows.extend(c.rows)
            self.exporters.extend(c.exports)

    def loader(self, config: dict, where: str) -> Callable:
        """The loader of the first of config's "architectures" that has one; `where` names the
        config file in the refusal."""
        architectures = config.get("architectures") or []
        for architecture in architectures:
            if architecture in self.loaders:
                return self.loaders[architecture]
        raise ValueError(
            f"{where}: architectures={architectures} has no converter; supported: "
            f"{', '.join(self.loaders)}"
        )

    def exporter(self, model) -> Exporter:
        """The one exporter that takes `model`; a ValueError says what each exporter of its
        class needs when none does."""
        candidates = [e for e in self.exporters if isinstance(model, e.model)]
        if not candidates:
            raise ValueError(f"no exporter for {type(model).__name__}")
        chosen = [e for e in candidates if e.when(model)]
        if len(chosen) > 1:  # overlapping predicates: a converter bug, named to be fixed
            raise ValueError(
                f"{len(chosen)} exporters take this {type(model).__name__}: "
                + "; ".join(e.needs for e in chosen)
            )
        if not chosen:
            raise ValueError(
                f"no exporter for this {type(model).__name__}: "
                + "; ".join(e.needs for e in candidates)
                + "; this one is none of them"
            )
        return chosen[0]
