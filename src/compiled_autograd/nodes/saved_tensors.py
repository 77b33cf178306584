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
packed value (`packed_meta`). Every later backward of the same graph and
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
tensor at any other sizes (nodes/learned.py `UnpackMetas.by_rule`; sizes or packed shapes, as an
index_fill's index length is not a size of the graph); it is checked at replay
as any prediction is, and dropped for good when it fails.

NOTE [Unpacked tensor subclasses]
Under tensor parallelism a checkpointed region recomputes DTensors: what its unpack hook returns
is a traceable wrapper subclass, whose placements and local shapes the checkpoint does not
record. They are learned as any hook's result is (the first backward of the graph and sizes runs
in eager), as a SubclassSpec and its inner tensors' metadata (nodes/learned.py subclass_unpack),
at those sizes only (no rule). The UNPACK call then returns the inner tensors, checked against
what was learned (a mismatch raises, and the next backward learns again), and the trace rebuilds
the subclass over them (Slot.out_specs), so the formulas that read it are traced through its
dispatch as those of a lifted DTensor are. A subclass that cannot be described so (an inner
tensor that is not plain, metadata that cannot be keyed by value) is unpredictable: unpacked when
the backward starts, which the graph does not take for a subclass (the whole backward in eager).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..values import OutputMeta, SlotKind, SubclassSpec
from .learned import LEARNED
from .state import _closure, _nested_code

FAMILY = "saved-tensor hooks"
UNPACK = "unpack"  # a saved tensor's unpack hook (NOTE [Unpacking in the graph])


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
    # (a subclass grad orders the call by its inner tensors: nothing of it is passed on)
    after = [x for a in after for x in (SubclassSpec.of(a)[1] if is_traceable_wrapper_subclass(a) else [a])]
    meta = t.in_graph_metas[hid]
    if isinstance(meta, SubclassMetas):  # NOTE [Unpacked tensor subclasses]: its inner tensors, rebuilt
        (t,), _ = t._call(UNPACK, hid, after, meta.inner, out_specs=((0, meta.spec),))
        return t
    (x,), _ = t._call(UNPACK, hid, after, [meta])
    t.unpacked_here[hid] = x  # (a backward resumed at a later unpack in this node gets it again: resume.held)
    return x


class SubclassMetas(NamedTuple):
    """What the graph is traced with for a subclass an unpack hook returns."""

    spec: SubclassSpec
    inner: list  # its inner tensors' OutputMetas (their shapes from the sizes, symbolic or not)


def in_graph_metas(in_graph, hooks, dims) -> dict:
    """Per saved tensor unpacked in the graph, the OutputMeta of what its hook returns, or a
    SubclassMetas for a subclass; `dims` their shapes in order."""
    out = {}
    for u in in_graph:
        if u.subclass:
            learned = hooks[u.hid].subclass
            inner = []
            for shape, dtype, device, order in learned.inner:
                inner.append(OutputMeta.dense(dims[: len(shape)], dtype, device, order))
                dims = dims[len(shape) :]
            out[u.hid] = SubclassMetas(learned.spec, inner)
        else:
            out[u.hid] = OutputMeta.dense(dims[: u.dim], u.dtype, u.device, u.order)
            dims = dims[u.dim :]
    return out


class Learn:
    """A backward whose user unpack hooks return what no earlier backward of this graph and
    sizes has shown (NOTE [Unpack metadata learned from the last backward]): it runs in
    eager autograd, each hook at its node, and `report` learns what each returned."""

    def __init__(self, capture, keys: dict):
        self.walk = capture
        self.keys = keys  # hooked tensor position -> learned key
        self.reported: set = set()

    def report(self, i, t) -> None:
        self.reported.add(i)
        if LEARNED.unpacks.learn(self.keys[i], t) is None:
            LEARNED.unpacks.mark_unpredictable(self.keys[i])

    def finish(self) -> None:
        """After the backward: a tensor eager did not unpack (its node's formula did not need
        it) gives nothing to learn; it is unpacked when the backward starts from then on."""
        for i, key in self.keys.items():
            if i not in self.reported:
                LEARNED.unpacks.mark_unpredictable(key)


def _known_unpack_hooks():
    """The code objects of checkpoint's and save_on_cpu's unpack hooks."""
    import torch.utils.checkpoint as ckpt

    return (
        _nested_code(ckpt._checkpoint_hook.__init__, "unpack_hook"),
        _nested_code(torch.autograd.graph.save_on_cpu.__init__, "unpack_from_cpu"),
    )


class Predictor:
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


def packed_meta(packed):
    """What a packed value shows of its tensors (shape, dtype, device): part of the learned
    key, so that a saved tensor packed with another shape, where nothing else in the graph
    changed (index_fill's index), is not predicted from the last one (a hook that packs a
    key into its own stash shows nothing: that case raises, NOTE [Unpack metadata learned
    from the last backward])."""
    if isinstance(packed, torch.Tensor):
        return (tuple(packed.shape), packed.dtype, packed.device)
    if isinstance(packed, (tuple, list)):
        return tuple(packed_meta(p) if isinstance(p, torch.Tensor) else type(p) for p in packed)
    return type(packed)


def hook_code(hook):
    fn = getattr(hook, "__func__", hook)
    return getattr(fn, "__code__", None) or type(hook)


def unpack(hook, packed):
    t = hook(packed)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"Output of saved tensor unpack_hook expected to be a Tensor but got result of type {type(t).__name__}")
    return t


def _run(capture, node, args, mask, metas, hooks, steal):
    """An UNPACK call: the hook of hooked saved tensor `node`, once (NOTE [Unpacking in the
    graph]); what it returns is checked against what was learned (NOTE [Unpack metadata
    learned from the last backward])."""
    pair, hooks[node] = hooks[node], None  # unpacked once, as eager does: the packed value can go
    if pair is None:
        raise RuntimeError("compiled_autograd: a saved tensor was unpacked twice by one graph")
    hook, packed, learned, subclass = pair
    del pair
    outs = [unpack(hook, packed)]
    del hook, packed
    if learned is not None and metas is not None:  # (a subclass: returned as it is, flattened by the kernel, Slot.out_specs)
        try:
            LEARNED.unpacks.check(learned, outs[0], metas, subclass.spec if subclass is not None else None)
        except RuntimeError as e:  # (where the call can stop the graph, it does: NOTE [A call output not as traced])
            raise NotAsLearned(outs[0]) from e
    return outs


def unpack_now(hooks, hid):
    """Hooked saved tensor `hid` unpacked by its hook, once, as eager's node unpacks it (a backward
    resumed in eager's order: NOTE [A call output not as traced], capture/resume.py)."""
    pair, hooks[hid] = hooks[hid], None
    if pair is None:
        raise RuntimeError("compiled_autograd: a saved tensor was unpacked twice by one backward")
    return unpack(pair[0], pair[1])


class NotAsLearned(RuntimeError):
    """An unpack hook returned other than what the graph was traced with (`value`)."""

    def __init__(self, value):
        super().__init__("not as learned")
        self.value = value


# its arguments only order it (what must be computed before it); its output, a tensor the
# hook made, has no grad of a node in it
SLOT_KINDS = (
    SlotKind(
        UNPACK,
        FAMILY,
        _run,
        reads_saved=False,
        shares_args=False,
        ordering_args=True,
        new_grads_go_nowhere=True,
        what="the unpack hook of a saved tensor",
        resumable=True,
    ),
)
