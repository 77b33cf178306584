"""What earlier backwards taught, kept across backwards: one typed store (`LEARNED`) with one
`reset()`. The families and stages that learn and read it say why each part exists:

  unpacks  what saved-tensor unpack hooks returned (NOTE [Unpack metadata learned from the
           last backward] in nodes/saved_tensors.py): walk/collect.py predicts from it, the
           UNPACK call checks it
  churn    the custom Function classes whose values change every step (NOTE [Functions whose
           values change every step] in nodes/function.py)
  layouts  how call outputs and opaque nodes' outputs were laid out at run time (NOTE [Layouts
           of call outputs] in calls/kernel.py; NOTE [Nodes made opaque by their trace] in
           cache/learning.py, which runs the backwards that learn them)
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from typing import NamedTuple

import torch

from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import Unkeyable
from ..values import SubclassSpec, SubclassUnpack, dense_order
from .state import value_key


@functools.cache
class LearnKey(NamedTuple):
    """Where a hooked saved tensor's unpacked metadata is learned and looked up (NOTE [Unpack
    metadata learned from the last backward])."""

    graph: tuple  # (a digest of the graph's native key, its sizes)
    position: int  # among the saved tensors with hooks
    code: object  # the unpack hook's code
    packed: object  # what the packed value shows of its tensors (packed_meta)


def _without_shapes(packed_meta):
    """packed_meta's structure without its shapes: each tensor's rank, dtype and device."""
    if isinstance(packed_meta, tuple) and len(packed_meta) == 3 and isinstance(packed_meta[1], torch.dtype):
        shape, dtype, device = packed_meta
        return (len(shape), dtype, device)
    if isinstance(packed_meta, tuple):
        return tuple(_without_shapes(p) for p in packed_meta)
    return packed_meta


def _packed_shapes(packed_meta) -> list:
    """The shapes of the tensors in a packed_meta, in order."""
    if isinstance(packed_meta, tuple) and len(packed_meta) == 3 and isinstance(packed_meta[1], torch.dtype):
        return [packed_meta[0]]
    if isinstance(packed_meta, tuple):
        return [s for p in packed_meta for s in _packed_shapes(p)]
    return []


_NO_RULE = (-1, None, None, None)  # UnpackMetas.rules: none holds, or one failed


class UnpackMetas:
    """What unpack hooks returned, (shape, dtype, device, dim order), by (graph's native key and
    sizes, position, hook code, packed value) (NOTE [Unpack metadata learned from the last
    backward] in nodes/saved_tensors.py), and the size-free rules learned from it."""

    LIMIT = 1 << 17  # entries (one per hooked tensor): a graph with more than this is never compiled

    def __init__(self):
        self.metas: dict = {}
        self.unpredictable: dict = {}
        # the size-free rules (NOTE [Unpack metadata learned from the last backward]): rule key -> (packed tensor position, dtype, device,
        # the (sizes, packed shapes) it held at: it predicts once there are two; None: it failed)
        self.rules: dict = {}
        self.orders: dict = {}  # rule key -> the dim order of what the hook returned last
        self.lock = threading.Lock()

    def get(self, key):
        return self.metas.get(key)

    @staticmethod
    def _rule_key(key):
        """A learned key without sizes: the graph's digest, position, hook code, and the packed
        value's structure (its tensors' ranks, dtypes and devices)."""
        (digest, _sizes), i, code, packed = key.graph, key.position, key.code, key.packed
        return (digest, i, code, _without_shapes(packed))

    def by_rule(self, key):
        """The metadata a confirmed rule predicts for `key` (sizes not seen before), or None."""
        rule = self.rules.get(self._rule_key(key))
        if rule is None or rule[3] is None or len(rule[3]) < 2:
            return None
        k, dtype, device, _ = rule
        shapes = _packed_shapes(key.packed)
        if k >= len(shapes):
            return None
        meta = (shapes[k], dtype, device, self.orders.get(self._rule_key(key)) or tuple(range(len(shapes[k]))))
        with self.lock:  # these sizes' next backward finds it directly (checked at replay as any)
            if len(self.metas) >= self.LIMIT:
                self.metas.pop(next(iter(self.metas)))
            self.metas[key] = meta
        return meta

    def learn(self, key, t):
        """Remember what the hook returned; None if it cannot be predicted."""
        if key in self.unpredictable:
            return None
        if is_traceable_wrapper_subclass(t):  # NOTE [Unpacked tensor subclasses] (nodes/saved_tensors.py)
            meta = subclass_unpack(t)
            if meta is not None:
                with self.lock:  # (at these sizes only: no rule, no order for other sizes)
                    if len(self.metas) >= self.LIMIT:
                        self.metas.pop(next(iter(self.metas)))
                    self.metas[key] = meta
                    self._set_rule(self._rule_key(key), _NO_RULE)
                    self.orders.pop(self._rule_key(key), None)
            return meta
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return None
        order = dense_order(t) or tuple(range(t.dim()))  # (not dense: copied into this at replay)
        meta = (tuple(t.shape), t.dtype, t.device, order)
        with self.lock:
            if len(self.metas) >= self.LIMIT:
                self.metas.pop(next(iter(self.metas)))
            self.metas[key] = meta
            self._learn_rule(key, meta[:3])
            rk = self._rule_key(key)
            if len(self.orders) >= self.LIMIT and rk not in self.orders:
                self.orders.pop(next(iter(self.orders)))
            self.orders[rk] = order
        return meta

    def order(self, key):
        """The layout a hook at this graph's position returned last (at any sizes), or None."""
        return self.orders.get(self._rule_key(key))

    def _learn_rule(self, key, meta) -> None:
        shape, dtype, device = meta
        same = [k for k, s in enumerate(_packed_shapes(key.packed)) if s == shape]
        rk = self._rule_key(key)
        rule = self.rules.get(rk)
        if rule is not None and rule[3] is None:
            return  # failed once: never again
        if len(same) != 1 or (rule is not None and rule[:3] != (same[0], dtype, device)):
            self._set_rule(rk, _NO_RULE)  # ambiguous, or not the rule it was
            return
        seen = rule[3] if rule is not None else frozenset()
        self._set_rule(rk, (same[0], dtype, device, seen | {(key.graph[1], key.packed)}))

    def _set_rule(self, rk, rule) -> None:
        if len(self.rules) >= self.LIMIT and rk not in self.rules:
            self.rules.pop(next(iter(self.rules)))
        self.rules[rk] = rule

    def is_unpredictable(self, key) -> bool:
        return key in self.unpredictable

    def mark_unpredictable(self, key) -> None:
        with self.lock:
            self.metas.pop(key, None)
            self._set_rule(self._rule_key(key), _NO_RULE)
            if len(self.unpredictable) >= self.LIMIT:
                self.unpredictable.pop(next(iter(self.unpredictable)))
            self.unpredictable[key] = True

    def check(self, key, t, metas, spec=None) -> None:
        """At replay: what the hook returned against the prediction (OutputMetas: its own, or
        its inner tensors' where it was a subclass of `spec`)."""
        if spec is None:
            inner = [t]
        elif (
            type(t) is spec.type
            and t.__tensor_flatten__()[1] == spec.meta
            and tuple(t.shape) == spec.size
            and tuple(t.stride()) == spec.stride
            and all(_same_const(getattr(t, n), c) for n, c in spec.consts)
        ):
            inner = SubclassSpec.of(t)[1]
        else:
            inner = []
        if len(inner) == len(metas) and all(
            type(x) in (torch.Tensor, torch.nn.Parameter) and list(x.shape) == list(m.shape) and x.dtype == m.dtype and x.device == m.device
            for x, m in zip(inner, metas)
        ):
            return
        m = metas[0]
        shape, dtype, device = (spec.size, spec.type.__name__, m.device) if spec is not None else (m.shape, m.dtype, m.device)
        self.mark_unpredictable(key)
        with self.lock:  # the graph's other hooks may have changed too: the next backward learns again
            for k in [k for k in self.metas if k.graph == key.graph]:
                del self.metas[k]
        got = f"{tuple(t.shape)}/{t.dtype}/{t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise RuntimeError(
            f"compiled_autograd: the unpack hook of a saved tensor returned {got}, where the previous "
            f"backward of this graph got {tuple(shape)}/{dtype}/{device}; the graph, traced with that, "
            "unpacks it when its node runs, as eager does (NOTE [Unpack metadata learned from the last "
            "backward]). From the next backward on this tensor is unpacked when the backward starts, and "
            "the next one learns again what the graph's other hooks return"
        )

    def clear(self):
        with self.lock:
            self.metas.clear()
            self.unpredictable.clear()
            self.rules.clear()
            self.orders.clear()


def _no_tensor(_):
    raise Unkeyable("a tensor in a subclass's flatten metadata")


def _same_const(a, b) -> bool:
    """Whether two inner attributes that are not tensors (DTensor's meshes) are the same by value:
    the graph rebuilds the subclass over the one it was traced with."""
    if a is b:
        return True
    try:
        return value_key(a, _no_tensor, user=True) == value_key(b, _no_tensor, user=True)
    except Unkeyable:
        return False


def subclass_unpack(t) -> SubclassUnpack | None:
    """What the graph needs to unpack `t`, a traceable wrapper subclass, as its inner tensors and
    rebuild it (NOTE [Unpacked tensor subclasses], nodes/saved_tensors.py); None where it cannot
    (an inner tensor not plain and strided, metadata that cannot be keyed by value)."""
    spec, inner = SubclassSpec.of(t)
    if not inner or any(type(x) is not torch.Tensor or x.layout != torch.strided for x in inner):
        return None

    try:
        meta_key = value_key(spec.meta, _no_tensor, user=True)
        consts = tuple((n, value_key(c, _no_tensor, user=True)) for n, c in spec.consts)
    except Unkeyable:
        return None
    metas = tuple((tuple(x.shape), x.dtype, x.device, dense_order(x) or tuple(range(x.dim()))) for x in inner)
    key = (spec.type, spec.names, meta_key, consts, spec.size, spec.stride, tuple((d, dev, len(s), o) for s, d, dev, o in metas))
    return SubclassUnpack(spec, metas, key)


class Churn:
    """Per custom Function class, the distinct sets of its values it was captured with, and
    the classes that now run opaquely (nodes/function.py note_capture)."""

    def __init__(self):
        self.sets: dict = {}  # cls -> the distinct sets of its values, one per capture
        self.opaque: dict = {}  # cls -> the reason its nodes now run opaquely
        self.lock = threading.Lock()

    def clear(self):
        with self.lock:
            self.sets.clear()
            self.opaque.clear()


MAX_RELAYOUTS = 3  # then a key keeps its graph and copies what comes in another layout
MAX_KEYS = 1024  # graph keys remembered per table


class Layouts:
    """Per graph key, the layouts its calls' and opaque nodes' outputs came in (NOTE [Layouts
    of call outputs]): what its next trace predicts."""

    def __init__(self):
        self.calls: dict = {}  # key -> {(slot, output): dim order seen at run time}
        self.relayouts: Counter = Counter()  # key -> captures made again for a layout seen
        self.reasons: dict = {}  # key -> the reason of its next capture
        self.nodes: dict = {}  # key -> {(node, output): layout seen}: the opaque nodes' outputs
        self.watched: dict = {}  # key -> the opaque nodes whose outputs a learning backward watched

    def learn_calls(self, key, seen: dict) -> int:
        """Remember the dense layouts `seen` ((slot, output) -> dim order) for `key`; how many
        are new (0 as well once the key was captured again MAX_RELAYOUTS times)."""
        table = self.calls.get(key, {})
        new = {where: order for where, order in seen.items() if table.get(where) != order}
        if not new or self.relayouts[key] >= MAX_RELAYOUTS:
            return 0
        if key not in self.calls and len(self.calls) >= MAX_KEYS:
            self.calls.pop(next(iter(self.calls)))
        self.calls[key] = {**table, **new}
        self.relayouts[key] += 1
        self.reasons[key] = f"{len(new)} call outputs came back in another layout than traced: captured again in those layouts"
        return len(new)

    def learn_nodes(self, key, seen: dict, watched) -> None:
        """What a learning backward saw of opaque nodes' outputs ((node, output) -> layout)."""
        if len(self.nodes) >= MAX_KEYS:
            self.nodes.pop(next(iter(self.nodes)))
        if len(self.watched) >= MAX_KEYS and key not in self.watched:
            self.watched.pop(next(iter(self.watched)))
        self.nodes[key] = {**self.nodes.get(key, {}), **seen}
        self.watched[key] = set(self.watched.get(key, ())) | set(watched)

    def of(self, key) -> dict:
        """What the trace of this key predicts from earlier backwards: (slot, output) -> layout
        for calls seen in another layout, ("node", index, output) -> layout for opaque nodes."""
        nodes = self.nodes.get(key) or {}
        return {**{("node", *where): layout for where, layout in nodes.items()}, **self.calls.get(key, {})}

    def unlearned_opaque(self, key, opaque) -> list:
        """Of Plan.opaque's rows `opaque`, the nodes no learning backward of this key watched
        yet (NOTE [Nodes made opaque by their trace] in cache/learning.py)."""
        seen = self.watched.get(key, ())
        return [i for i, _, _ in opaque if i not in seen]

    def clear(self) -> None:
        for table in (self.calls, self.relayouts, self.reasons, self.nodes, self.watched):
            table.clear()


class Learned:
    """Everything learned across backwards, by what it is about."""

    def __init__(self):
        self.unpacks = UnpackMetas()
        self.churn = Churn()
        self.layouts = Layouts()

    def reset(self) -> None:
        self.unpacks.clear()
        self.churn.clear()
        self.layouts.clear()


LEARNED = Learned()
