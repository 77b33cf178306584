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

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import Fallback, Unkeyable
from ..nodes.function import _collect_pynode, kept_indices
from ..nodes.saved_tensors import LEARNED, Learn, LearnKey, _hook_code, _packed_meta, _Predictor, unpack
from ..replay.graph_task import in_graph_task
from ..values import GraphKey, NodeKind, NodeRow
from . import precheck
from .state import _value_key

PYNODE_KIND = NodeKind.PYNODE


@dataclass
class Collected:
    """One backward's graph: `key` (structure, constants, tensor metadata and
    layouts) and `sizes` (the node SymInts, then each lifted tensor's dims)
    together identify a static graph; a dynamic graph matches `key`, the
    sizes it keeps static, and its guards."""

    capture: Any
    key: tuple
    sizes: tuple
    n_size_inputs: int
    lifted: list
    n_native: int
    unpacked: tuple  # per hooked saved tensor: its lifted index (unpacked up front), or -1 when unpacked in the graph
    pynodes: dict = field(default_factory=dict)
    hooks: list = field(default_factory=list)  # (unpack_hook, packed, learned key or None) per hooked saved tensor
    in_graph: tuple = ()  # an InGraph per saved tensor unpacked in the graph
    grad_on_ctx: bool = False  # a leaf's .grad, accumulated into by this backward, is kept on ctx
    wrappers: tuple = ()  # a Wrapper per lifted tensor subclass (docs/design/subclasses.md)

    # ints saved by torch.compile'd regions for their inlined backwards, and sizes kept on custom
    # Functions' ctx (NOTE [Sizes kept on ctx]), in `sizes` before those shapes
    n_aot: int = 0

    @property
    def in_graph_start(self) -> int:
        """Where the shapes of the tensors unpacked in the graph start in `sizes` (they end it)."""
        return len(self.sizes) - sum(u.dim for u in self.in_graph)

    @property
    def aot_start(self) -> int:
        """Where the ints of the inlined AOTAutograd backwards start in `sizes`."""
        return self.in_graph_start - self.n_aot

    @property
    def up_front(self) -> list:
        """The lifted index of every tensor unpacked when the backward started."""
        return [i for i in self.unpacked if i >= 0]

    @functools.cached_property
    def tensor_positions(self) -> tuple:
        """For each lifted tensor, where its geometry sits in `sizes`: (start, dim, strides
        included); then comes its storage offset."""
        out, pos = [], self.n_size_inputs
        for t in self.lifted:
            with_strides = not isinstance(layout_signature(t), str)
            out.append((pos, t.dim(), with_strides))
            pos += t.dim() * (2 if with_strides else 1) + 1
        return tuple(out)

    @functools.cached_property
    def arriving(self) -> frozenset:
        """The lifted indices of tensors whose storage is empty now and gets its data from a
        hook before their node runs (NOTE [Tensors whose data arrives during the backward])."""
        return frozenset(i for i, t in enumerate(self.lifted) if _arrives(t))

    @functools.cached_property
    def nodes(self) -> tuple:
        """A NodeRow per node, in the engine's order."""
        return NodeRow.rows(self.capture)


def _arrives(t) -> bool:
    """A tensor with elements whose storage holds none (the native helper keys it as such)."""
    return isinstance(t, torch.Tensor) and t.numel() > 0 and not t._is_zerotensor() and t.untyped_storage().nbytes() == 0


class InGraph(NamedTuple):
    """A saved tensor unpacked inside the graph, at its node (NOTE [Unpacking in the graph])."""

    hid: int  # its position among the saved tensors with hooks
    dtype: torch.dtype
    device: torch.device
    dim: int  # its shape is in the sizes vector (Collected.in_graph_start on)
    order: tuple  # its dims from outermost to innermost in memory (ops.OutputMeta.dense)


class Wrapper(NamedTuple):
    """A lifted traceable wrapper subclass (DTensor, a user's), flattened: its inner tensors are
    lifted (graph inputs), and the trace rebuilds it from their fakes (docs/design/subclasses.md
    section 1)."""

    index: int  # its own lifted index (a placeholder the graph does not read)
    type: type
    inner: tuple  # (attribute name, lifted index) per inner tensor, in __tensor_flatten__'s order
    consts: tuple  # (attribute name, object) per inner attribute that is not a tensor (DTensor's mesh)
    meta: Any  # __tensor_flatten__'s metadata, keyed by value
    size: tuple  # its outer size and stride: __tensor_unflatten__'s outer_size, outer_stride
    stride: tuple

    def rebuild(self, args):
        """The subclass over `args`' inner tensors (the trace's fakes)."""
        inner = {name: args[i] for name, i in self.inner}
        inner.update(self.consts)
        return self.type.__tensor_unflatten__(inner, self.meta, self.size, self.stride)


def _no_tensor(t):
    raise Unkeyable("a tensor in a subclass's flatten metadata")


def _meta_key(v):
    """The key of a subclass's flatten metadata or of an inner attribute that is not a tensor:
    _value_key's; frozen dataclasses, named tuples (TensorMeta, ShardOrderEntry) and DTensor's
    placements by value; a DeviceMesh by what a graph bakes in of it: its ranks, dim names and process group names
    (the funcol ops' group_name) (docs/design/subclasses.md section 1)."""
    import dataclasses

    if dataclasses.is_dataclass(v) and not isinstance(v, type) and v.__dataclass_params__.frozen:
        return ("dc", type(v), tuple((f.name, _meta_key(getattr(v, f.name))) for f in dataclasses.fields(v)))
    if type(v).__module__.startswith("torch.distributed.tensor.placement_types"):
        return ("placement", v)  # (C++ objects in 2.13, hashable and equal by value)
    if type(v).__name__ == "DeviceMesh" and type(v).__module__.startswith("torch.distributed"):
        groups = tuple(v.get_group(d).group_name for d in range(v.ndim))
        return ("mesh", v.device_type, tuple(v.mesh.flatten().tolist()), tuple(v.mesh.shape), v.mesh_dim_names, groups)
    if type(v) is tuple or type(v) is list or (isinstance(v, tuple) and hasattr(v, "_fields")):
        return (type(v), tuple(_meta_key(x) for x in v))
    return _value_key(v, _no_tensor, user=True)


def _flatten_wrappers(capture, lifted: list, lift) -> tuple[tuple, tuple]:
    """(a Wrapper per lifted wrapper subclass, their key entries); raises Fallback where one is
    not supported (yet). Their inner tensors are lifted through `lift` (deduplicated by
    identity: two subclasses may share one, a ScaledTensor's scale)."""
    wrappers, keys = [], []
    for i in capture.wrapped():
        t = lifted[i]
        if not precheck.SUBCLASSES:
            raise Fallback("tensor subclass")
        if not is_traceable_wrapper_subclass(t):
            raise Fallback(f"tensor subclass {type(t).__name__} without __tensor_flatten__")
        names, meta = t.__tensor_flatten__()
        inner, consts = [], []
        for name in names:
            v = getattr(t, name)
            if not isinstance(v, torch.Tensor):  # (DTensor's mesh: kept by reference, keyed by value)
                try:
                    consts.append((name, v, _meta_key(v)))
                except Unkeyable as e:
                    raise Fallback(f"tensor subclass {type(t).__name__} whose {name} is unkeyable: {e}") from None
                continue
            if type(v) not in (torch.Tensor, torch.nn.Parameter):
                raise Fallback(f"tensor subclass {type(t).__name__} whose {name} is a {type(v).__name__} (not yet)")
            try:
                inner.append((name, lift(v)))
            except Unkeyable as e:
                raise Fallback(f"tensor subclass {type(t).__name__} whose {name} is a {e}") from None
        try:
            meta_key = _meta_key(meta)
        except Unkeyable as e:
            raise Fallback(f"tensor subclass {type(t).__name__} whose flatten metadata is unkeyable: {e}") from None
        wrappers.append(Wrapper(i, type(t), tuple(inner), tuple((n, v) for n, v, _ in consts), meta, tuple(t.shape), tuple(t.stride())))
        keys.append(("W", i, type(t), tuple(names), meta_key, tuple(j for _, j in inner), tuple((n, k) for n, _, k in consts)))
    return tuple(wrappers), tuple(keys)


def layout_signature(t: torch.Tensor):
    """What a tensor's strides are, as far as the key is concerned: 'C' or
    channels-last when they follow from its sizes, else the strides."""
    if t.is_contiguous():
        return "C"
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "L"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "M"
    return t.stride()


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
    if wrapped and not precheck.SUBCLASSES:
        raise Fallback("tensor subclass")
    if wrapped and (saved_hooks or pynode_indices):
        raise Fallback("tensor subclass with saved-tensor hooks or custom Functions (not yet: docs/design/subclasses.md)")
    if not saved_hooks and not pynode_indices and not wrapped:
        lifted = capture.lifted()
        return Collected(
            capture=capture,
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
    predict = _Predictor()
    metas, learn, native_key = [], {}, None
    for i, (hook, packed) in enumerate(saved_hooks):
        meta, learned = predict(hook, packed), None
        if meta is None or meta[3] is None:
            if native_key is None:  # (a digest: the table must not hold every graph's key)
                native_key = (hashlib.blake2b(capture.key(), digest_size=16).digest(), tuple(capture.sizes()))
            learned = LearnKey(native_key, i, _hook_code(hook), _packed_meta(packed))
        if meta is not None and meta[3] is None:
            # a checkpoint's recomputed tensor: its layout is learned (NOTE [Layouts of call
            # outputs], replay/calls.py), from an eager backward when no backward showed it yet
            order = LEARNED.order(learned)
            if order is None and not LEARNED.is_unpredictable(learned):
                learn[i] = learned
            meta, learned = (*meta[:3], order or tuple(range(len(meta[0])))), None
        elif meta is None:
            meta = LEARNED.get(learned)
            if meta is None and not LEARNED.is_unpredictable(learned):
                meta = LEARNED.by_rule(learned)
                if meta is None:
                    learn[i] = learned
        metas.append((meta, learned))
    if learn:
        return Learn(capture, learn)
    lifted = list(capture.lifted())
    n_native = len(lifted)
    lift = _Lifter(lifted)
    wrappers, wrapper_keys = _flatten_wrappers(capture, lifted, lift)
    unpacked, in_graph, shapes, hooks = [], [], [], []
    for i, ((hook, packed), (meta, learned)) in enumerate(zip(saved_hooks, metas)):
        if meta is None:  # unpredictable: unpacked now, a graph input
            t = unpack(hook, packed)
            capture.hand_over(i, t, keep_graph)
            unpacked.append(lift(t))
            hooks.append(None)
            continue
        shape, dtype, device, order = meta
        unpacked.append(-1)
        in_graph.append(InGraph(i, dtype, device, len(shape), order))
        shapes.extend(shape)
        hooks.append((hook, packed, learned))
    pykeys = []
    pynodes = {}
    for idx in pynode_indices:
        k, info = _collect_pynode(capture, idx, lift, keep_graph)
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
        capture=capture,
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
    )
    if wrappers and any(n.execute and (n.opaque or n.hooks.any) for n in collected.nodes):
        # (a call's arguments and outputs would need rebuild specs: docs/design/subclasses.md, step 4)
        raise Fallback("tensor subclass with hooks or opaque nodes (not yet: docs/design/subclasses.md)")
    return collected


def _grad_on_ctx(capture, pynodes, lifted) -> bool:
    """Whether a custom Function keeps on ctx (or its backward reads from a global or a
    closure) the `.grad` of a leaf this backward accumulates into: eager's AccumulateGrad
    adds into it in place, before a later node reads it, so AccumulateGrad then runs in the
    graph at its eager position (not after the graph)."""
    kept = {id(lifted[i]) for i in kept_indices(pynodes, lifted)}
    return bool(kept) and any(id(g) in kept for g in capture.accumulated_grads())


