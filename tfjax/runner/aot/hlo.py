"""Reading XLA's program text: compiled HLO into computations of instructions (read by brace
depth), the trip counts of its while loops, the bytes of its shapes; and the float32 share of a
lowered program's matmuls (StableHLO).

What the compiler wrote is read, never guessed: a loop whose trip count cannot be read gives
None, and the caller says so (`tfjax.runner.aot.collectives`).
"""

from __future__ import annotations

import dataclasses
import math
import re

_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64|c64)\[([\d,]*)\]")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_NAME = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = ")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_PASSING = ("copy", "copy-start", "copy-done", "convert", "bitcast")  # what they hold, moved


@dataclasses.dataclass
class Instruction:
    name: str
    root: bool
    shape: str  # of the result
    opcode: str
    operands: list[str]  # their names
    literal: str  # the text in the parentheses (a constant's value)
    attributes: str  # the text after them

    def attribute(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attributes)
        return m.group(1) if m else None


def _instruction(statement: str) -> Instruction | None:
    m = _NAME.match(statement)
    op = m and _OPCODE.search(statement, m.end())
    if not op:
        return None
    depth, end = 1, op.end()
    while depth and end < len(statement):
        depth += {"(": 1, ")": -1}.get(statement[end], 0)
        end += 1
    inside = statement[op.end() : end - 1]
    return Instruction(
        name=m.group(2),
        root=bool(m.group(1)),
        shape=statement[m.end() : op.start()],
        opcode=op.group(1),
        operands=re.findall(r"%([\w.\-]+)", inside),
        literal=inside.strip(),
        attributes=statement[end:],
    )


def computations(text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """The computations of HLO text by name, and the entry's name.

    Read by brace depth, not line by line: an instruction's attributes may span lines and close
    braces at a line's start (the splash-attention kernel's metadata ends with `}}` mid-
    computation). Braces inside strings (backend_config's JSON) do not count.
    """
    comps, entry, name, depth, pending = {}, None, None, 0, []
    for line in text.splitlines():
        plain = _STRING.sub("", line)
        before, depth = depth, depth + plain.count("{") - plain.count("}")
        if before == 0:  # a module line, or a computation's header when it opens a brace
            m = _HEADER.match(line)
            name = m.group(1) if m and depth > 0 else None
            if name is not None:
                comps[name] = []
                entry = name if line.startswith("ENTRY") else entry
            depth = max(depth, 0)
        elif depth <= 0:  # the computation's closing brace
            name, depth, pending = None, 0, []
        else:
            pending.append(line)
            if depth == 1:  # the instruction is complete
                inst = _instruction(" ".join(pending))
                pending = []
                if inst is not None and name is not None:
                    comps[name].append(inst)
    return comps, entry


def through(by_name: dict, name: str) -> Instruction | None:
    """The instruction `name` is a copy, convert or bitcast of (or itself)."""
    inst = by_name.get(name)
    while inst is not None and inst.opcode in _PASSING:
        inst = by_name.get(inst.operands[0]) if inst.operands else None
    return inst


def _integer(inst: Instruction | None) -> int | None:
    if inst is not None and inst.opcode == "constant" and re.fullmatch(r"-?\d+", inst.literal):
        return int(inst.literal)
    return None


def _element(inst: Instruction | None, by_name: dict) -> int | None:
    """Which element of its computation's parameter `inst` reads (get-tuple-element), or None."""
    if inst is None or inst.opcode != "get-tuple-element" or not inst.operands:
        return None
    source = by_name.get(inst.operands[0])
    index = re.search(r"\bindex=(\d+)", inst.attributes)
    return int(index.group(1)) if source and source.opcode == "parameter" and index else None


def trip_count(loop: Instruction, caller: dict, comps: dict) -> int | None:
    """How many times a while loop runs its body: XLA's own figure (`known_trip_count` in the
    backend_config, where it has analysed the loop), else read from its induction variable (the
    initial value, the step the body adds, the bound and direction of the condition's compare);
    None when neither is there to read. A condition that also ends the loop early (decoding
    stops when every row has ended) gives the most it can run."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attributes)
    if known:
        return int(known.group(1))
    cond, body = comps.get(loop.attribute("condition")), comps.get(loop.attribute("body"))
    if not cond or not body or len(loop.operands) != 1:
        return None
    in_cond, in_body = {i.name: i for i in cond}, {i.name: i for i in body}
    init = through(caller, loop.operands[0])
    update = next((i for i in body if i.root), None)
    if init is None or update is None or init.opcode != "tuple" or update.opcode != "tuple":
        return None
    counts = []
    for test in _conjuncts(next((i for i in cond if i.root), None), in_cond):
        direction = re.search(r"direction=(\w+)", test.attributes)
        if test.opcode != "compare" or not direction or len(test.operands) != 2:
            continue
        direction = direction.group(1)
        counter, bound = (through(in_cond, o) for o in test.operands)
        if _element(counter, in_cond) is None:  # the bound on the left: read it the other way
            counter, bound = bound, counter
            direction = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}.get(direction, direction)
        index, bound = _element(counter, in_cond), _integer(bound)
        if index is None or bound is None or index >= len(init.operands):
            continue
        start = _integer(through(caller, init.operands[index]))
        step = _step(through(in_body, update.operands[index]), index, in_body)
        if start is not None and step:
            counts.append(_trips(start, step, direction, bound))
    counts = [c for c in counts if c is not None]
    return min(counts) if counts else None


def _conjuncts(inst: Instruction | None, by_name: dict):
    """The conditions a loop's condition requires all of (the operands of its `and`s)."""
    if inst is not None and inst.opcode == "and":
        for o in inst.operands:
            yield from _conjuncts(through(by_name, o), by_name)
    elif inst is not None:
        yield inst


def _step(change: Instruction | None, index: int, body: dict) -> int | None:
    """What a loop's body adds to element `index` of its state each trip (the constant of
    `add(i, c)` or `subtract(i, c)`), or None."""
    if change is None or change.opcode not in ("add", "subtract") or len(change.operands) != 2:
        return None
    a, b = (through(body, o) for o in change.operands)
    if change.opcode == "add" and _element(b, body) == index:
        a, b = b, a
    if _element(a, body) != index or _integer(b) is None:
        return None
    return _integer(b) * (1 if change.opcode == "add" else -1)


def _trips(start: int, step: int, direction: str, bound: int) -> int | None:
    """Iterations of `for (i = start; i <direction> bound; i += step)`; None if it never ends."""
    if direction in ("GT", "GE"):  # counting down: the mirror image of counting up
        start, step, bound, direction = -start, -step, -bound, "L" + direction[1]
    if direction == "LE":
        direction, bound = "LT", bound + 1
    if direction == "LT":
        if start >= bound:
            return 0
        return -((start - bound) // step) if step > 0 else None
    if direction == "NE":
        trips, left = divmod(bound - start, step)
        return trips if left == 0 and trips >= 0 else None
    return None


def array_bytes(shape: str) -> list[int]:
    """The bytes of each array of an HLO shape ("f32[8,128]", "(bf16[4], s32[])")."""
    return [
        _BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
        for t, dims in _SHAPE.findall(shape)
    ]


def shape_bytes(shape: str) -> int:
    return sum(array_bytes(shape))


_DOT = re.compile(
    r"stablehlo\.dot_general .*contracting_dims = \[([\d, ]*)\] x .*"
    r": \(tensor<([\dx]*)x(\w+)>, tensor<[\dx]*x(\w+)>\) -> tensor<([\dx]*)x\w+>"
)


def f32_dot_fraction(stablehlo: str) -> float:
    """Of the matmul FLOPs a lowered program asks for (StableHLO text, before any backend
    rewrites them; loop bodies counted once), the share with a float32 operand: JAX lowers a
    float32 x bf16 matmul for GPUs as a float32 one."""
    flops = {"f32": 0.0, "all": 0.0}
    for m in _DOT.finditer(stablehlo):
        contracting, lhs, lhs_type, rhs_type, out = m.groups()
        lhs_dims = [int(d) for d in lhs.split("x") if d]
        k = math.prod(lhs_dims[int(i)] for i in contracting.split(",") if i.strip())
        f = 2.0 * math.prod(int(d) for d in out.split("x") if d) * k
        flops["all"] += f
        if "f32" in (lhs_type, rhs_type):
            flops["f32"] += f
    return flops["f32"] / flops["all"] if flops["all"] else 0.0
