"""The bytes each kind of collective of a compiled program produces per step.

Each all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute of the compiled
HLO counts the bytes of the full array it works on (a reduce-scatter's operand, the others'
result) times the trip counts of the loops around it (XLA's `known_trip_count`, else read from
the loop's induction variable, `tfjax.runner.aot.hlo`; a loop whose count cannot be read is
counted once, with a warning). What XLA:TPU writes in other forms is named as what it is:
FSDP's gathers and gradient reduce-scatters done as collective matmuls (windowed einsums: loops
of collective-permutes passing shards round the ring, each multiplied as it arrives; on 8 chips
each shard is passed 9 times, 9/8 of the array), and gathers written as all-reduces. Bytes, not
time: the figure does not say which transfers the compiler overlaps with compute.
"""

from __future__ import annotations

import collections
import re

from tfjax.runner.aot import hlo
from tfjax.runner.aot.hlo import Instruction, through

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"^(" + "|".join(COLLECTIVES) + r")(-start|-done)?$")
# XLA's SPMD partitioner names the loops of a windowed einsum (a collective matmul) so, and its
# own passes find them by these names: an all-gather or a reduce-scatter done as a ring of
# collective-permutes, each step's shard multiplied as it arrives.
_WINDOWED = {
    "windowed_dot_general_body_ag": "all-gather (collective matmul)",
    "windowed_dot_general_body_rs": "reduce-scatter (collective matmul)",
}
# A reduce-scatter as XLA:TPU writes it: an all-reduce sliced, fused in a computation so named.
_REDUCE_SCATTER_FUSION = "all-reduce-scatter"


def _calls(comps, name) -> list[tuple[str, int | None, str | None]]:
    """(callee, times per run, collective-matmul label) for each computation `name` calls."""
    out, by_name = [], {i.name: i for i in comps[name]}
    for inst in comps[name]:
        if inst.opcode == "while":
            trips = hlo.trip_count(inst, by_name, comps)
            out.append((inst.attribute("body") or "", trips, _window_label(inst)))
        elif inst.opcode not in ("async-update", "async-done"):  # async-start calls it once
            for group in re.findall(
                r"\b(?:calls|branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)",
                inst.attributes,
            ):
                out += [(c.strip(" {}%"), 1, None) for c in group.split(",") if c.strip(" {}")]
    return out


def _runs(comps, entry):
    """How many times each computation runs per run of the entry (loops multiply), the
    collective-matmul label of those inside a windowed einsum's loop, and the loops whose trip
    count could not be read (counted once)."""
    calls = {name: _calls(comps, name) for name in comps}
    order, seen = [], set()

    def visit(name):  # callees after callers (reverse post-order)
        if name in seen or name not in comps:
            return
        seen.add(name)
        for callee, _, _ in calls[name]:
            visit(callee)
        order.append(name)

    visit(entry)
    runs, labels, uncounted = collections.Counter({entry: 1}), {}, []
    for name in reversed(order):
        for callee, times, label in calls[name]:
            if times is None:
                uncounted.append(callee)
            runs[callee] += runs[name] * (1 if times is None else times)
            if label or name in labels:
                labels[callee] = label or labels[name]
    return runs, labels, uncounted


def _window_label(inst: Instruction) -> str | None:
    """The collective-matmul label of a windowed einsum's while loop; None for other ops."""
    body = inst.attribute("body") if inst.opcode == "while" else None
    return next((label for key, label in _WINDOWED.items() if key in (body or "")), None)


def _loop_edges(insts, by_name) -> dict[str, str]:
    """{collective-permute: label} for the permutes of a windowed einsum outside its loop: the
    shard sent before an all-gather's loop, the partial sum sent after a reduce-scatter's."""
    edges = {}
    for loop in insts:
        label = _window_label(loop)
        if label is None or not loop.operands:
            continue
        if label.startswith("all-gather"):  # a permute whose shard goes into the loop
            init = through(by_name, loop.operands[0])
            for o in init.operands if init is not None and init.opcode == "tuple" else []:
                inst = through(by_name, o)
                if inst is not None and inst.opcode.startswith("collective-permute"):
                    edges[inst.name] = label
        else:  # a permute of what the loop gives back
            for inst in insts:
                if inst.opcode in ("collective-permute", "collective-permute-start"):
                    source = through(by_name, inst.operands[0]) if inst.operands else None
                    if source is not None and source.opcode == "get-tuple-element":
                        source = through(by_name, source.operands[0])
                    if source is loop:
                        edges[inst.name] = label
    for inst in insts:  # an async permute counts at its -done: label it as its -start
        if inst.opcode == "collective-permute-done" and set(inst.operands[:1]) & edges.keys():
            edges[inst.name] = edges[inst.operands[0]]
    return edges


def collective_bytes(text: str) -> tuple[dict[str, float], list[str]]:
    """{kind: bytes per execution} of the collectives in compiled HLO text, and the bodies of
    the while loops whose trip count could not be read (their collectives are counted once).

    Each collective counts the full array it works on: a reduce-scatter its operand, the others
    their result (an async one at its -done), times the runs of its computation. What XLA:TPU
    writes in other forms is counted as what it is: its fused reduce-scatter (an all-reduce
    sliced) as a reduce-scatter, a gather written as an all-reduce (of zeros but the local
    shard) as "all-gather (as all-reduce)", and the permutes of a windowed einsum's loop as
    "all-gather (collective matmul)" or "reduce-scatter (collective matmul)": FSDP's gathers of
    weights and reductions of gradients.
    """
    comps, entry = hlo.computations(text)
    runs, labels, uncounted = _runs(comps, entry)
    out = collections.Counter()
    for name, insts in comps.items():
        if not runs.get(name):
            continue
        by_name = {i.name: i for i in insts}
        edges = None
        for inst in insts:
            m = _COLLECTIVE.match(inst.opcode)
            if not m or m.group(2) == "-start":
                continue
            kind = m.group(1)
            if kind == "all-reduce" and name.startswith(_REDUCE_SCATTER_FUSION):
                kind = "reduce-scatter"
            if kind == "collective-permute":
                edges = _loop_edges(insts, by_name) if edges is None else edges
                kind = labels.get(name) or edges.get(inst.name) or kind
            done = m.group(2) == "-done"
            start = by_name.get(inst.operands[0]) if done and inst.operands else inst
            operands = start.operands if start is not None else []
            if kind == "reduce-scatter" and m.group(1) == "reduce-scatter":  # the array reduced
                size = sum(hlo.shape_bytes(by_name[o].shape) for o in operands if o in by_name)
                out[kind] += size * runs[name]
            elif kind == "all-reduce":
                for part, size in _all_reduce_parts(inst.shape, operands, by_name, comps):
                    out[part] += size * runs[name]
            else:
                out[kind] += hlo.shape_bytes(inst.shape) * runs[name]
    return dict(out), uncounted


def _all_reduce_parts(shape: str, operands: list[str], by_name: dict, comps: dict):
    """(kind, bytes) for each array an all-reduce sums. XLA:TPU writes some gathers (FSDP's on
    large slices) as an all-reduce of zeros with each device's shard written in its place:
    those count as "all-gather (as all-reduce)"."""
    sizes = hlo.array_bytes(shape)
    if len(sizes) != len(operands):
        return [("all-reduce", sum(sizes))]
    parts = []
    for size, operand in zip(sizes, operands, strict=True):
        gather = _written_into_zeros(through(by_name, operand), by_name, comps)
        parts.append(("all-gather (as all-reduce)" if gather else "all-reduce", size))
    return parts


def _written_into_zeros(inst: Instruction | None, by_name: dict, comps: dict) -> bool:
    """Whether `inst` writes a piece into an array of zeros: a dynamic-update-slice of a
    broadcast 0, or a fusion whose root is one."""
    if inst is not None and inst.opcode == "dynamic-update-slice":
        return _is_zeros(through(by_name, inst.operands[0]), by_name)
    if inst is None or inst.opcode != "fusion":
        return False
    fused = comps.get(inst.attribute("calls")) or []
    in_fusion = {i.name: i for i in fused}
    root = next((i for i in fused if i.root), None)
    if root is None or root.opcode != "dynamic-update-slice":
        return False
    base = through(in_fusion, root.operands[0])
    if base is not None and base.opcode == "parameter" and base.literal.isdigit():
        outer = inst.operands[int(base.literal)] if int(base.literal) < len(inst.operands) else ""
        return _is_zeros(through(by_name, outer), by_name)  # the zeros come from outside
    return _is_zeros(base, in_fusion)


def _is_zeros(inst: Instruction | None, by_name: dict) -> bool:
    """Whether `inst` is a broadcast of the constant 0."""
    if inst is None or inst.opcode != "broadcast" or not inst.operands:
        return False
    value = through(by_name, inst.operands[0])
    return value is not None and value.opcode == "constant" and value.literal in ("0", "-0")
