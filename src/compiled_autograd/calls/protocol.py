"""What one `compiled_autograd::call` says (NOTE [Opaque calls] in calls/__init__.py): its
arguments by name, the bits of its flags, how its outputs are encoded in the graph, and the
frame its kernel resolves a slot against. What a call of each kind runs is its family's row
in the slot-kind table (nodes/__init__.py SLOT_KINDS).

The native helper reads the same encodings: `decode_meta` (DTYPES, DEVICE_TYPES, LAYOUTS in
this order) and ReplayFrame's fields by values.h's indices.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import torch

from ..values import OutputMeta

# dtype <-> small int, for the operator schema
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex32,
]
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
DEVICE_TYPES = ["cpu", "cuda", "mps", "xpu", "meta", "hpu", "privateuseone"]
LAYOUTS = [torch.strided, torch.sparse_coo]


def device_code(device) -> int:
    d = torch.device(device)
    return DEVICE_TYPES.index(d.type) * 1024 + (0 if d.index is None else d.index + 1)


@functools.lru_cache(maxsize=None)
def device_of(code: int) -> torch.device:
    kind, index = divmod(code, 1024)
    return torch.device(DEVICE_TYPES[kind]) if index == 0 else torch.device(DEVICE_TYPES[kind], index - 1)


class CallArgs(NamedTuple):
    """The arguments of one `compiled_autograd::call` (NOTE [Opaque calls]), by name.

    args:  the tensors the call runs on; then, in this order, what the trace appended:
           with `Slot.in_flags`, which of them are defined (a bool tensor); `Slot.n_after`
           values only there to order the call; `Slot.n_watch` saved tensors it checks;
           `flags >> PASSES_SHIFT` graph inputs it returns as its last outputs
    meta:  its outputs as traced (`encode_meta` of OutputMetas)
    flags: the bits below"""

    slot: int
    args: list
    meta: list
    flags: int

    @staticmethod
    def of(node) -> "CallArgs":
        return CallArgs(*node.args)

    @property
    def n_outputs(self) -> int:
        return len(decode_meta(self.meta))


# the bits of a call's `flags` argument (they are in the graph's code, so a change of what
# our inductor lowering does with a bit is a new bit: no compiled artifact from before matches)
DEFINEDNESS = 1  # the call also returns which of its outputs are defined
KEEPS_INPUTS = 2  # an output may be one of its unshared inputs: their buffers are never reused
# set on every call: our inductor lowering frees the buffers it keeps from reuse at their last
# use (NOTE [Freed, never reused], compile/inductor.py); code compiled before that had no such bit
FREED_NOT_REUSED = 16
# set on every call: inductor's code calls it directly, not through the dispatcher
# (compile/inductor.py `_register_inductor_lowering`); code compiled before calls the op
DIRECT = 32
# an ACCUMULATE call whose grad AccumulateGrad may take as `.grad` (NOTE [Stealing a fresh
# grad] in nodes/accumulate.py): inductor's lowering keeps its buffer from reuse (compile/inductor.py)
HANDS_OVER = 64
# flags >> PASSES_SHIFT: how many of its last arguments the call also returns, as its last
# outputs (graph inputs read after it: NOTE [Hooks may change what the graph reads], capture/passes.py)
PASSES_SHIFT = 8


def encode_meta(metas: Sequence[OutputMeta]) -> list:
    """The call's `meta` argument: per output, rank, dtype code, device code, layout code,
    shape, strides (the one encoding: the native helper's `decode_meta` reads the same)."""
    out: list = []
    for m in metas:
        out += [len(m.shape), DTYPE_CODE[m.dtype], device_code(m.device), LAYOUTS.index(m.layout), *m.shape, *m.strides]
    return out


def decode_meta(meta: Sequence) -> list[OutputMeta]:
    out, pos = [], 0
    while pos < len(meta):
        rank, dtype, device, layout = (int(v) for v in meta[pos : pos + 4])
        pos += 4
        shape, strides = list(meta[pos : pos + rank]), list(meta[pos + rank : pos + 2 * rank])
        out.append(OutputMeta(shape, DTYPES[dtype], device_of(device), strides, LAYOUTS[layout]))
        pos += 2 * rank
    return out


class ReplayFrame(NamedTuple):
    """What the calls of one running graph resolve against (calls/kernel.py `replaying`; the
    native helper reads it by values.h's field indices)."""

    walk: object  # the backward's collected graph (the native GraphWalk)
    slots: tuple  # the plan's Slots
    outside: object  # the dispatch keys the backward call excluded (calls run with them)
    hooks: object  # a values.HookedTensor per hooked saved tensor, for UNPACK calls
    steal: object  # None, or the graph inputs' storages when AccumulateGrad may steal (NOTE [Stealing a fresh grad])
    keep: bool  # the compiled code never writes into a call's inputs (NOTE [Outputs the graph owns])
    versions: object  # slot -> saved tensors' versions it checks (NOTE [Hooks may change what the graph reads])
    ctx: object  # slot -> custom Functions' ctx snapshots checked after it (Plan.ctx_checks)
    releases: object  # slot -> nodes whose saved variables are freed after it
    observed: object  # (slot, output) -> layout of an output copied into the traced one
    refs: object  # (slot, output) -> a value a call handed on by reference (NOTE [Values passed by reference])
