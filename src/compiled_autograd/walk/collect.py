"""Collect: what one backward call's graph is made of, as a key and lifted inputs.

The native collector (native/collect.cpp) walks the graph and keys every built-in
node. This module adds what only Python can see:
  * custom autograd.Function nodes: the Function class, needs_input_grad, the
    materialize flags, every non-tensor ctx attribute by value (but sizes kept
    on ctx go to the sizes vector: NOTE [Sizes kept on ctx]), tensors saved
    with save_for_backward or stored on ctx (lifted). A ctx attribute we cannot
    key by value makes that node opaque (it runs as is, inside the graph), and
    an opaque node keys none of its state (NOTE [Opaque nodes keep their state
    out of the key]).
  * saved tensors that carry saved_tensors_hooks: unpacked inside the graph,
    at the node that uses them, when what the hook will return is known
    beforehand (NOTE [Unpacking in the graph]) or was learned from an eager
    backward of the same graph (NOTE [Unpack metadata learned from the last
    backward]); otherwise their unpack hooks run now, when the backward starts,
    and the unpacked tensors are lifted.
"""

from __future__ import annotations

import hashlib

import torch

from ..errors import Fallback, Unkeyable
from ..nodes.function import collect_pynode, kept_indices
from ..nodes.learned import LEARNED, LearnKey
from ..nodes.saved_tensors import Learn, Predictor, hook_code, packed_meta, unpack
from ..graph_task import in_graph_task
from ..values import Collected, GraphKey, HookedTensor, InGraph, SubclassUnpack
from . import precheck
from .subclasses import flatten_wrappers


class _Lifter:
    """Lifts the tensors only Python sees (a custom Function's saved tensors and ctx
    attributes) after the native ones: each one's key entries and its geometry (the sizes
    vector) as the native collector writes them (`tensor_key`, native helper)."""

    def __init__(self, lifted: list):
        from .. import native

        self._key = native.load().tensor_key
        self.lifted = lifted
        self.index = {id(t): i for i, t in enumerate(lifted)}
        self.extra_keys: list = []
        self.geometry: list = []

    def __call__(self, t: torch.Tensor) -> int:
        i = self.index.get(id(t))
        if i is None:
            try:
                if type(t) not in (torch.Tensor, torch.nn.Parameter):
                    raise ValueError("tensor subclass")
                key, geometry = self._key(t)
            except ValueError as e:  # (the native helper's reason)
                raise Unkeyable(str(e)) from None
            self.extra_keys.append(key)
            self.geometry += geometry
            i = self.index[id(t)] = len(self.lifted)
            self.lifted.append(t)
        return i

    def mark(self) -> tuple:
        return len(self.lifted), len(self.extra_keys), len(self.geometry)

    def rollback(self, mark: tuple) -> None:
        """Forget what was lifted since `mark` (a node that turned out to run opaquely: what it
        holds is not the graph's business, NOTE [Opaque nodes keep their state out of the key])."""
        n, k, g = mark
        for t in self.lifted[n:]:
            del self.index[id(t)]
        del self.lifted[n:], self.extra_keys[k:], self.geometry[g:]


def collect(capture, run_unpack_hooks: bool = True, keep_graph: bool = True) -> Collected | None:
    """None when the graph has saved-tensor hooks and `run_unpack_hooks` is False: the caller
    falls back to eager, which must be the first to run them (a hook may pop what it stashed).
    A tensor unpacked here is handed to its saved variable (NOTE [Handing unpacked tensors to
    their saved variables], native helper): nothing else in this backward runs its hook again;
    with `keep_graph`, the caller puts the hooks back (`capture.restore_saved_hooks()`)."""
    saved_hooks = capture.take_saved_hooks()
    if saved_hooks and not run_unpack_hooks:
        return None
    pynode_indices = capture.pynode_indices()
    wrapped = capture.wrapped()
    if wrapped and not precheck.subclasses_on():
        raise Fallback("tensor subclass")
    if not saved_hooks and not pynode_indices and not wrapped:
        lifted = capture.lifted()
        return Collected(
            walk=capture,
            key=GraphKey(capture.key(), (), (), (), (), False),
            sizes=tuple(capture.sizes()),
            n_size_inputs=capture.num_size_inputs(),
            lifted=lifted,
            n_native=len(lifted),
            unpacked=(),
        )
    # unpack hooks may key state by the current graph task (non-reentrant
    # checkpointing recomputes once per backward): run them inside one (~60 us: not when
    # no unpack hook runs here)
    if not saved_hooks and not capture.pynodes_have_saved_hooks(pynode_indices):
        return _collect_python(capture, saved_hooks, pynode_indices, keep_graph)
    return in_graph_task(lambda: _collect_python(capture, saved_hooks, pynode_indices, keep_graph))


def _collect_python(capture, saved_hooks, pynode_indices, keep_graph) -> Collected | Learn:
    predict = Predictor()
    metas, learn, native_key = [], {}, None
    for i, (hook, packed) in enumerate(saved_hooks):
        meta, learned = predict(hook, packed), None
        if meta is None or meta[3] is None:
            if native_key is None:  # (a digest: the table must not hold every graph's key)
                native_key = (hashlib.blake2b(capture.key(), digest_size=16).digest(), tuple(capture.sizes()))
            learned = LearnKey(native_key, i, hook_code(hook), packed_meta(packed))
            subclass = LEARNED.unpacks.get(learned)
            if isinstance(subclass, SubclassUnpack):  # NOTE [Unpacked tensor subclasses] (nodes/saved_tensors.py)
                metas.append((subclass, learned))
                continue
        if meta is not None and meta[3] is None:
            # a checkpoint's recomputed tensor: its layout is learned (NOTE [Layouts of call
            # outputs], calls/kernel.py), from an eager backward when no backward showed it yet
            order = LEARNED.unpacks.order(learned)
            if order is None and not LEARNED.unpacks.is_unpredictable(learned):
                learn[i] = learned
            meta, learned = (*meta[:3], order or tuple(range(len(meta[0])))), None
        elif meta is None:
            meta = LEARNED.unpacks.get(learned)
            if meta is None and not LEARNED.unpacks.is_unpredictable(learned):
                meta = LEARNED.unpacks.by_rule(learned)
                if meta is None:
                    learn[i] = learned
        metas.append((meta, learned))
    if learn:
        return Learn(capture, learn)
    lifted = list(capture.lifted())
    n_native = len(lifted)
    lift = _Lifter(lifted)
    wrappers, wrapper_keys, held = flatten_wrappers(capture, lifted, lift)
    unpacked, in_graph, shapes, hooks = [], [], [], []
    for i, ((hook, packed), (meta, learned)) in enumerate(zip(saved_hooks, metas)):
        if meta is None:  # unpredictable: unpacked now, a graph input
            t = unpack(hook, packed)
            capture.hand_over(i, t, keep_graph)
            unpacked.append(lift(t))
            hooks.append(None)
            continue
        unpacked.append(-1)
        if isinstance(meta, SubclassUnpack):  # (its inner tensors' shapes are sizes; the rest is keyed)
            in_graph.append(InGraph(i, None, None, meta.dim, None, meta.key))
            shapes.extend(d for shape, _, _, _ in meta.inner for d in shape)
            hooks.append(HookedTensor(hook, packed, learned, meta))
            continue
        shape, dtype, device, order = meta
        in_graph.append(InGraph(i, dtype, device, len(shape), order))
        shapes.extend(shape)
        hooks.append(HookedTensor(hook, packed, learned))
    pykeys = []
    pynodes = {}
    for idx in pynode_indices:
        k, info = collect_pynode(capture, idx, lift, keep_graph)
        pykeys.append((idx, k))
        pynodes[idx] = info
    grad_on_ctx = _grad_on_ctx(capture, pynodes, lifted)
    key = GraphKey(capture.key(), tuple(pykeys), tuple(unpacked), tuple(in_graph), tuple(lift.extra_keys) + wrapper_keys, grad_on_ctx)
    aot_ints: list = []  # sizes, as a dynamic capture may make them symbolic
    for info in pynodes.values():
        if info.symints is not None:
            info.aot_start = len(aot_ints)
            aot_ints += [s for s in info.symints if type(s) is int]
        elif info.ctx_ints:  # NOTE [Sizes kept on ctx]
            info.aot_start = len(aot_ints)
            aot_ints += info.ctx_ints
    sizes = tuple(capture.sizes()) + tuple(lift.geometry) + tuple(aot_ints) + tuple(shapes)
    collected = Collected(
        walk=capture,
        key=key,
        sizes=sizes,
        n_size_inputs=capture.num_size_inputs(),
        lifted=lifted,
        n_native=n_native,
        unpacked=tuple(unpacked),
        pynodes=pynodes,
        hooks=hooks if in_graph else [],
        in_graph=tuple(in_graph),
        grad_on_ctx=grad_on_ctx,
        n_aot=len(aot_ints),
        wrappers=wrappers,
        held=held,
    )
    return collected


def _grad_on_ctx(capture, pynodes, lifted) -> bool:
    """Whether a custom Function keeps on ctx (or its backward reads from a global or a
    closure) the `.grad` of a leaf this backward accumulates into: eager's AccumulateGrad
    adds into it in place, before a later node reads it, so AccumulateGrad then runs in the
    graph at its eager position (not after the graph)."""
    kept = {id(lifted[i]) for i in kept_indices(pynodes, lifted)}
    return bool(kept) and any(id(g) in kept for g in capture.accumulated_grads())
