"""The gradients the trace carries between nodes, with what says whether each is defined at
run time (NOTE [Undefined grads of opaque nodes], capture/trace.py)."""

from __future__ import annotations

import torch


def defined(bits):
    """Whether a value carrying `bits` is defined: a 0-dim bool tensor of the graph."""
    if len(bits) == 1:  # the common case (one hook or opaque node upstream): no stack, no reduction
        flag, pos = bits[0]
        return flag[pos]
    return torch.stack([flag[pos] for flag, pos in bits]).any()


class Value:
    """A gradient flowing in the traced graph and what its definedness depends on."""

    __slots__ = ("t", "bits", "exact", "version")

    def __init__(self, t, bits=None, exact=False):
        self.t = t
        self.bits = bits  # None: defined; else tuple of (flag tensor, position)
        # zeros whenever undefined: what a call returned (it gives zeros for a None), or a
        # sum of such values; no formula ran on it since, so it needs no mask (`_masked`)
        self.exact = exact
        self.version = t._version if exact else None


def sum_grads(a: Value | None, b: Value | None) -> Value | None:
    """Two grads for one node input, summed as the engine's InputBuffer sums them: an
    undefined one adds nothing. What a value holds while undefined is zeros at the call
    that flagged it, but a formula may turn zeros into NaN on the way (0 / 0 where x = 0
    in sqrt's), so a value that may be undefined is masked before the add."""
    if a is None:
        return b
    if b is None:
        return a
    bits = None if a.bits is None or b.bits is None else union_bits(a.bits, b.bits)
    return Value(_masked(a) + _masked(b), bits, exact=a.exact and b.exact)


def _masked(v: Value):
    if v.bits is None or (v.exact and v.t._version == v.version):  # (the zeros the mask would add)
        return v.t
    return torch.where(defined(v.bits), v.t, 0.0)


def union_bits(*bit_sets) -> tuple:
    """The flags of several values, each once: a grad summed from two paths
    that carry the same flags, and every node after it, would otherwise double
    its list at each such sum."""
    seen, out = set(), []
    for bits in bit_sets:
        for b in bits:
            k = (id(b[0]), b[1])
            if k not in seen:
                seen.add(k)
                out.append(b)
    return tuple(out)
