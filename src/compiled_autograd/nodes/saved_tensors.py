"""Saved tensors with saved_tensors_hooks: what their unpack hooks will return (predicted from
what was packed, or learned from an eager backward), and their unpacking inside the graph,
each when its node runs.

NOTE [Unpacking in the graph]
Eager unpacks a saved tensor when its node runs: non-reentrant checkpointing
recomputes a region's activations when the backward reaches the region, and
they are freed as the region's nodes finish. Unpacking every hooked tensor when
the backward starts would hold all regions' activations at once: no memory
saved. So a hooked tensor becomes a `compiled_autograd::call(UNPACK)` at its
node's position in the graph (the native tracer asks for it when the node's
formula unpacks it). The graph must be traced before the hook runs, and a cache
hit decided without running it, so this needs the unpacked tensor's shape,
dtype and device from what was packed, exactly:
  * torch.utils.checkpoint (non-reentrant, default determinism check): the
    checkpoint records each packed tensor's shape, dtype and device, and its
    recomputation raises if a recomputed tensor differs from them;
  * save_on_cpu: it returns the packed CPU tensor moved to the recorded device.
Those predictions are part of the key (shapes in the sizes vector, so a
dynamic graph can make them symbolic). At replay the call checks what the hook
returned against the prediction, and raises rather than misread a tensor.

NOTE [Unpack metadata learned from the last backward]
Any other hook (activation offloading, compression, a user's stash) gives no
such prediction: what its packed value holds is its own business. The first
backward of a graph and sizes with such hooks runs in eager autograd
(`stats().learning_backwards`), each hook at its node as eager runs it, with
the saved variable's hooks wrapped so that what each returns is reported
(NOTE [Handing unpacked tensors to their saved variables], native helper).
What it returned is remembered under the graph's native key, its sizes, the
tensor's position, the hook's code and the shapes of the tensors in the
packed value (`_packed_meta`). Every later backward of the same graph and
sizes predicts the same metadata, is traced (or hits) with each tensor
unpacked in the graph when its node runs, as eager does: offloading and
compression keep their memory saving from the first backward on, and a
hook's in-place change to a stashed tensor before its node runs is seen. A
hook that then returns something else raises (the graph ran part way: it
cannot fall back) and that tensor is unpacked when the backward starts from
then on, and so is one that returned something other than a plain strided
tensor, or that eager did not unpack (its node's formula did not need it).
Sizes that change every step (a stream of sequence lengths) would make every
backward a learning one. So what is learned is also generalized, by one
rule only: the unpacked tensor has the shape of the one tensor in the packed
value that had its shape (offloading and compression keep the shape), with the
dtype and device it had. A rule seen to hold at two different sizes of the same
graph, position, hook and packed structure (ranks, dtypes, devices) predicts the
tensor at any other sizes (`_Learned.by_rule`; sizes or packed shapes, as an
index_fill's index length is not a size of the graph); it is checked at replay
as any prediction is, and dropped for good when it fails.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch

from ..walk.state import _closure, _nested_code

from ..values import UNPACK


def unpack_in_graph(t, hid: int):
    """The native tracer asks for hooked saved tensor `hid` (NOTE [Unpacking in the graph]).

    The call's inputs (unused) say what must be computed before it. The node's incoming
    grads: a compiler may move a call with no inputs to the start of the graph (inductor
    does), which would unpack, and recompute, everything up front again. And the graph
    results computed since the last unpack (grads for AccumulateGrad or grad()): nothing
    inside consumes them, so a compiler may leave them for later (inductor did), keeping
    what they read alive while the next checkpointed region is recomputed; eager
    accumulates each as soon as it is computed."""
    after = [t for t in t.node_inputs if t is not None] + t.unconsumed
    t.unconsumed = []
    (t,), _ = t._call(UNPACK, hid, after, [t.in_graph_metas[hid]])
    return t


class Learn:
    """A backward whose user unpack hooks return what no earlier backward of this graph and
    sizes has shown (NOTE [Unpack metadata learned from the last backward]): it runs in
    eager autograd, each hook at its node, and `report` learns what each returned."""

    def __init__(self, capture, keys: dict):
        self.capture = capture
        self.keys = keys  # hooked tensor position -> learned key
        self.reported: set = set()

    def report(self, i, t) -> None:
        self.reported.add(i)
        if LEARNED.learn(self.keys[i], t) is None:
            LEARNED.mark_unpredictable(self.keys[i])

    def finish(self) -> None:
        """After the backward: a tensor eager did not unpack (its node's formula did not need
        it) gives nothing to learn; it is unpacked when the backward starts from then on."""
        for i, key in self.keys.items():
            if i not in self.reported:
                LEARNED.mark_unpredictable(key)


@functools.cache
class LearnKey(NamedTuple):
    """Where a hooked saved tensor's unpacked metadata is learned and looked up (NOTE [Unpack
    metadata learned from the last backward])."""

    graph: tuple  # (a digest of the graph's native key, its sizes)
    position: int  # among the saved tensors with hooks
    code: object  # the unpack hook's code
    packed: object  # what the packed value shows of its tensors (_packed_meta)


def _known_unpack_hooks():
    """The code objects of checkpoint's and save_on_cpu's unpack hooks."""
    import torch.utils.checkpoint as ckpt

    return (
        _nested_code(ckpt._checkpoint_hook.__init__, "unpack_hook"),
        _nested_code(torch.autograd.graph.save_on_cpu.__init__, "unpack_from_cpu"),
    )


class _Predictor:
    """What an unpack hook will return, (shape, dtype, device), for the hooks
    whose result is known from what was packed (NOTE [Unpacking in the graph]);
    None for any other."""

    def __init__(self):
        import torch.utils.checkpoint as ckpt

        self._ckpt = ckpt
        self._ckpt_unpack, self._cpu_unpack = _known_unpack_hooks()
        self._holders: dict[int, dict] = {}  # id(checkpoint frame) -> {id(holder): position}

    def __call__(self, hook, packed):
        code = getattr(hook, "__code__", None)
        if code is None:
            return None
        try:
            if code is self._ckpt_unpack:
                return self._checkpointed(_closure(hook)["frame"], packed)
            if code is self._cpu_unpack:
                device, t = packed
                if isinstance(device, torch.device) and type(t) is torch.Tensor and t.layout == torch.strided:
                    # (it packed a contiguous copy, and unpacks that, moved)
                    return tuple(t.shape), t.dtype, device, tuple(range(t.dim()))
        except (KeyError, AttributeError, TypeError, ValueError):  # another torch's internals
            return None
        return None

    def _checkpointed(self, frame, holder):
        # the recomputation raises unless each recomputed tensor has the shape,
        # dtype and device recorded here when it was packed (the default check)
        if frame.metadata_fn is not getattr(self._ckpt, "_default_meta_extractor", None) or frame.ignore_saved_mismatch:
            return None
        index = self._holders.get(id(frame))
        if index is None:
            index = self._holders[id(frame)] = {id(r()): i for i, r in enumerate(frame.weak_holders)}
        i = index.get(id(holder))
        if i is None or i >= len(frame.x_metadatas):
            return None
        meta = frame.x_metadatas[i]
        if not isinstance(meta, dict) or not isinstance(meta.get("device"), torch.device):
            return None
        return tuple(meta["shape"]), meta["dtype"], meta["device"], None  # (its layout is learned)


def _packed_meta(packed):
    """What a packed value shows of its tensors (shape, dtype, device): part of the learned
    key, so that a saved tensor packed with another shape, where nothing else in the graph
    changed (index_fill's index), is not predicted from the last one (a hook that packs a
    key into its own stash shows nothing: that case raises, NOTE [Unpack metadata learned
    from the last backward])."""
    if isinstance(packed, torch.Tensor):
        return (tuple(packed.shape), packed.dtype, packed.device)
    if isinstance(packed, (tuple, list)):
        return tuple(_packed_meta(p) if isinstance(p, torch.Tensor) else type(p) for p in packed)
    return type(packed)


def _without_shapes(packed_meta):
    """_packed_meta's structure without its shapes: each tensor's rank, dtype and device."""
    if isinstance(packed_meta, tuple) and len(packed_meta) == 3 and isinstance(packed_meta[1], torch.dtype):
        shape, dtype, device = packed_meta
        return (len(shape), dtype, device)
    if isinstance(packed_meta, tuple):
        return tuple(_without_shapes(p) for p in packed_meta)
    return packed_meta


def _packed_shapes(packed_meta) -> list:
    """The shapes of the tensors in a _packed_meta, in order."""
    if isinstance(packed_meta, tuple) and len(packed_meta) == 3 and isinstance(packed_meta[1], torch.dtype):
        return [packed_meta[0]]
    if isinstance(packed_meta, tuple):
        return [s for p in packed_meta for s in _packed_shapes(p)]
    return []


def _hook_code(hook):
    fn = getattr(hook, "__func__", hook)
    return getattr(fn, "__code__", None) or type(hook)


_NO_RULE = (-1, None, None, None)  # _Learned.rules: none holds, or one failed


class _Learned:
    """NOTE [Unpack metadata learned from the last backward]: (shape, dtype, device) of
    what an unpack hook returned, by (graph's native key and sizes, position, hook code)."""

    LIMIT = 1 << 17  # entries (one per hooked tensor): a graph with more than this is never compiled

    def __init__(self):
        self.metas: dict = {}
        self.unpredictable: dict = {}
        # the size-free rules (NOTE above): rule key -> (packed tensor position, dtype, device,
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
        if key in self.unpredictable or type(t) is not torch.Tensor or t.layout != torch.strided:
            return None
        from ..values import dense_order

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

    def check(self, key, t, shape, dtype, device) -> None:
        """At replay: what the hook returned against the prediction."""
        if isinstance(t, torch.Tensor) and list(t.shape) == list(shape) and t.dtype == dtype and t.device == device:
            return
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


LEARNED = _Learned()


def unpack(hook, packed):
    t = hook(packed)
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"Output of saved tensor unpack_hook expected to be a Tensor but got result of type {type(t)}"
        )
    return t
