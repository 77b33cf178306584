"""What the stages hand each other, each defined once and read by name:
the walk's node rows and what it collected (`Collected`); the keys; how a call's
outputs are laid out (`OutputMeta`) and what a kind of call is (`SlotKind`); the plan
a capture hands the replay; how a compiled graph is called. (The call's own encoding
is calls/protocol.py's.)

The native helper builds some of them as plain tuples in the field order given
here (its `GraphWalk.nodes()` makes NodeRows' tuples); nothing reads them by
position but the constructors below.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence, Union

import torch


BackendLike = Union[str, Callable]  # a registered backend's name, or a callable(gm, example_inputs) -> callable


class NodeKind(enum.IntEnum):
    """How the native walker classed a node (native/values.h `enum Kind`)."""

    GENERIC = 0  # implements torch's compiled-autograd interface: traced through apply_with_saved
    ACCUMULATE = 1  # AccumulateGrad
    PYNODE = 2  # a custom autograd.Function: its Python backward is traced
    OPAQUE = 3  # runs as is inside the graph (a C++ custom Function, ...)


class NodeFamily(NamedTuple):
    """One family of nodes, as its module under nodes/ defines it (nodes/__init__.py FAMILIES,
    by the walk's NodeKind): the trace, the passes, the learning backwards and explain read it."""

    name: str  # as explain() and dump() name its nodes
    kind: NodeKind
    # (tracer, node index, grads, graph args) -> the node's outputs; None: the tracer's loop
    # applies it itself (AccumulateGrad)
    trace: Callable | None
    color: str = "#ffffff"  # its nodes in dump()'s picture
    leaf: bool = False  # applies a leaf's grad (AccumulateGrad): the tensor hooks on it are the leaf's
    opaque_by_name: bool = True  # enable(opaque=...) may name it
    hooks_read_saved: bool = True  # a hook on it may read saved tensors (NOTE [Saved tensors freed as eager frees them])
    live: bool = False  # a live record may take it (NOTE [Recording on the real tensors] in capture/record.py)


class Hooks(NamedTuple):
    """How many hooks of each kind a node has, as the walk found them."""

    tensor_pre: int  # tensor pre-hooks (`tensor.register_hook`)
    retains: int  # retain_grad()
    pre: int  # `grad_fn.register_prehook`
    post: int  # `grad_fn.register_hook`
    post_accumulate: int  # a leaf's post-accumulate-grad hooks (AccumulateGrad)

    @property
    def any(self) -> bool:
        return any(self)


class NodeRow(NamedTuple):
    """One node of the backward, in the engine's order (`Collected.nodes`)."""

    name: str
    kind: NodeKind
    execute: bool  # the backward runs it (not only a node `inputs=` captures at)
    opaque: bool  # the walker decided it runs as is
    opaque_reason: str
    edges: tuple  # (node index or -1, input_nr) per output
    captures: tuple  # (input_nr, result index) where grad() captures what reaches it
    hooks: Hooks
    num_inputs: int
    edge_sizes: tuple  # per edge, where its input metadata's sizes start in the sizes vector (-1: none)
    size_start: int  # where this node's saved sizes start in the sizes vector

    @staticmethod
    def rows(capture) -> tuple:
        """The walk's nodes, from the native helper's tuples."""
        return tuple(
            NodeRow(name, NodeKind(kind), execute, opaque, reason, tuple(edges), tuple(caps), Hooks(*hooks), n, tuple(sizes), start)
            for name, kind, execute, opaque, reason, edges, caps, hooks, n, sizes, start in capture.nodes()
        )


@dataclass
class Collected:
    """One backward's graph: `key` (structure, constants, tensor metadata and
    layouts) and `sizes` (the node SymInts, then each lifted tensor's dims)
    together identify a static graph; a dynamic graph matches `key`, the
    sizes it keeps static, and its guards."""

    walk: Any  # the native walk of this backward (GraphWalk)
    key: tuple
    sizes: tuple
    n_size_inputs: int
    lifted: list
    n_native: int
    unpacked: tuple  # per hooked saved tensor: its lifted index (unpacked up front), or -1 when unpacked in the graph
    pynodes: dict = field(default_factory=dict)
    hooks: list = field(default_factory=list)  # a HookedTensor (None: unpacked up front) per hooked saved tensor
    in_graph: tuple = ()  # an InGraph per saved tensor unpacked in the graph
    grad_on_ctx: bool = False  # a leaf's .grad, accumulated into by this backward, is kept on ctx
    wrappers: tuple = ()  # a Wrapper per lifted tensor subclass (walk/subclasses.py; docs/design/subclasses.md)
    # lifted indices of values held by reference (a root grad of a subclass without
    # __tensor_flatten__: NOTE [Values passed by reference], nodes/references.py)
    held: tuple = ()

    # ints saved by torch.compile'd regions for their inlined backwards, and sizes kept on custom
    # Functions' ctx (NOTE [Sizes kept on ctx]), in `sizes` before those shapes
    n_aot: int = 0

    @property
    def subclasses(self) -> bool:
        """Whether the graph traces through a tensor subclass: a lifted one, or one a saved-tensor
        hook returns (NOTE [Unpacked tensor subclasses], nodes/saved_tensors.py)."""
        return bool(self.wrappers) or any(u.subclass for u in self.in_graph)

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
        return NodeRow.rows(self.walk)


def _arrives(t) -> bool:
    """A tensor with elements whose storage holds none (the native helper keys it as such)."""
    return isinstance(t, torch.Tensor) and t.numel() > 0 and not t._is_zerotensor() and t.untyped_storage().nbytes() == 0


class InGraph(NamedTuple):
    """A saved tensor unpacked inside the graph, at its node (NOTE [Unpacking in the graph])."""

    hid: int  # its position among the saved tensors with hooks
    dtype: torch.dtype
    device: torch.device
    dim: int  # its shape is in the sizes vector (Collected.in_graph_start on)
    order: tuple  # its dims from outermost to innermost in memory (OutputMeta.dense)
    # a tensor subclass (NOTE [Unpacked tensor subclasses], nodes/saved_tensors.py): the key of its
    # SubclassUnpack (then dtype, device and order are None and `dim` counts its inner tensors' dims)
    subclass: tuple = ()


def layout_signature(t: torch.Tensor):
    """What a tensor's strides are, as far as the key is concerned: 'C' or
    channels-last when they follow from its sizes, else the strides."""
    if t.is_nested:  # (held by reference, its geometry not keyed: native tensor_key_into)
        return "N"
    if t.is_contiguous():
        return "C"
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "L"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "M"
    return t.stride()


class GraphKey(NamedTuple):
    """What a backward's graph is, for the cache (walk/collect.py): with its sizes, a static
    graph; a dynamic graph matches the key, the sizes it keeps static, and its guards."""

    native: bytes  # the native walk's key: structure, constants, edges' metadata, lifted tensors
    functions: tuple  # (node index, FunctionKey) per custom Function node
    unpacked: tuple  # per hooked saved tensor: its lifted index (unpacked up front), or -1 (in the graph)
    in_graph: tuple  # an InGraph per saved tensor unpacked in the graph
    extra: tuple  # the metadata of the tensors only Python lifts
    grad_on_ctx: bool  # a leaf's .grad this backward accumulates into is kept on ctx


class CacheKey(NamedTuple):
    """The key of the cache: the graph and what else its compiled code bakes in."""

    backend: object  # Config.backend_key: the backend and its options
    global_state: tuple  # walk/precheck.py global_state(): what a formula may branch on
    opaque: tuple  # enable(opaque=...)
    create_graph: bool
    graph: GraphKey


class NodeSummary(NamedTuple):
    """A node as a cached graph remembers it, for `explain()` and `dump()`."""

    name: str
    kind: NodeKind
    hooks: Hooks
    opaque_reason: str | None  # why it ran opaquely in this graph, or None
    edges: tuple


class OutputMeta(NamedTuple):
    """One output of a call as the graph was traced with it (NOTE [Layouts of call outputs]):
    strided and dense, its strides those of `torch.empty_permuted(shape, order)` for some dim
    order; or sparse COO (strides unused)."""

    shape: Sequence  # ints, or SymInts in a dynamic graph
    dtype: torch.dtype
    device: torch.device
    strides: Sequence
    layout: torch.layout = torch.strided

    def empty(self) -> torch.Tensor:
        if self.layout != torch.strided:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device, layout=self.layout)
        return torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device=self.device)

    def has_layout(self, t: torch.Tensor) -> bool:
        """Whether t is laid out as this says (strides where they matter: dims longer than 1)."""
        if t.layout != self.layout:
            return False
        if t.layout != torch.strided or t.numel() == 0:
            return True
        return all(n <= 1 or a == b for n, a, b in zip(self.shape, t.stride(), self.strides))

    def conformed(self, t: torch.Tensor) -> torch.Tensor:
        """t's values in this layout (a copy)."""
        if self.layout != torch.strided:
            return t.to_sparse() if t.layout == torch.strided else t.to_dense().to_sparse()
        if t.layout != torch.strided:
            t = t.to_dense()
        return self.empty().copy_(t)

    @staticmethod
    def dense(shape, dtype, device, order: Sequence | None = None) -> "OutputMeta":
        """The layout `torch.empty_permuted(shape, order)` has (contiguous: order None)."""
        order = range(len(shape)) if order is None else order
        strides, step = [0] * len(shape), 1
        for d in reversed(tuple(order)):
            strides[d] = step
            step = step * shape[d]
        return OutputMeta(list(shape), dtype, device, strides)

    @staticmethod
    def like(t: torch.Tensor) -> "OutputMeta":
        """As `empty_like(t)` lays out its result."""
        if t.layout == torch.sparse_coo:
            return OutputMeta(list(t.shape), t.dtype, t.device, [0] * t.dim(), torch.sparse_coo)
        return OutputMeta.dense(t.shape, t.dtype, t.device, dim_order(t))


# What a call output of a tensor subclass, where the graph has a plain tensor, teaches its next
# trace, in the layouts learned per call output (NOTE [A call output not as traced]): hold that
# output by reference (NOTE [Values passed by reference])
REFERENCE = "reference"


def is_plain(t) -> bool:
    """Whether t is what a graph computes on: a plain tensor (no subclass of any kind; a
    Parameter is one)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def observed_layout(t: torch.Tensor):
    """How a call output that came in another layout than traced was laid out, for the next
    capture (NOTE [Layouts of call outputs]): its dim order if dense, "sparse_coo", or None
    (nothing the trace can predict: it is copied each time)."""
    if t.layout == torch.sparse_coo:
        return "sparse_coo"
    if t.layout != torch.strided:
        return None
    return dense_order(t)


def dim_order(t: torch.Tensor) -> tuple:
    """The dims of t from outermost to innermost in memory, as `empty_like` lays out its
    result (guard-free on symbolic sizes); t has that layout iff it is dense."""
    if t.dim() <= 1:
        return tuple(range(t.dim()))
    from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

    perm, _ = compute_elementwise_output_logical_to_physical_perm(t)
    return tuple(perm)


def dense_order(t: torch.Tensor) -> tuple | None:
    """t's dim order if t is dense in it (a permutation of a contiguous tensor), else None."""
    order = dim_order(t)
    return order if OutputMeta.dense(t.shape, t.dtype, t.device, order).has_layout(t) else None


# -- the plan of a captured graph --------------------------------------------------


class Slot(NamedTuple):
    """One opaque call of a graph (NOTE [Opaque calls], calls/__init__.py)."""

    kind: str
    node: int  # index of the node (or hooked saved tensor, for UNPACK)
    mask: tuple  # per output: whether the graph was traced with it defined
    in_flags: bool  # its last argument says which arguments are defined
    # an ACCUMULATE call's grad is memory the graph made (NOTE [Stealing a fresh grad], nodes/accumulate.py)
    fresh: bool = False
    # how many of its last arguments only order it (NOTE [Hooks may change what the graph reads])
    n_after: int = 0
    # the arguments something else in the graph reads too: a hook must not change them in place
    shared: tuple = ()
    # how many of its last arguments are saved tensors read after it, whose versions it checks
    # (NOTE [Hooks may change what the graph reads]); Plan.watch has their lifted indices
    n_watch: int = 0
    # the node in whose step the call runs (an UNPACK call's: the node that unpacks)
    at: int = -1
    # tensor subclass arguments passed as their inner tensors, rebuilt before the call: a
    # (position, SubclassSpec) per subclass argument (docs/design/subclasses.md section 5)
    rebuild: tuple = ()
    # (output position, SubclassSpec) per output that is a tensor subclass, returned as its
    # inner tensors (a tensor hook's new value of a DTensor grad): checked and flattened by the
    # kernel, rebuilt by the graph
    out_specs: tuple = ()
    # NOTE [Values passed by reference] (nodes/references.py): None, or what of its arguments
    # and outputs are values held beside the graph
    by_reference: "ByReference | None" = None
    # how many of its last arguments (before the passed ones) are what the graph holds when it
    # makes the call (ResumePoint.values): a call whose output is not as traced stops the graph
    # there, and the backward goes on from them in eager's order (NOTE [A call output not as
    # traced], capture/resume.py); -1: it cannot stop the graph (no resume point)
    n_resume: int = -1


class ByReference(NamedTuple):
    """A call's values held beside the graph (NOTE [Values passed by reference],
    nodes/references.py). A source names a value: (slot, output position) of the call that
    handed it on, or ("lifted", index) for a root grad held from the start."""

    args: tuple  # (argument position, source) per argument that is a token: the value replaces it
    outs: tuple  # the output positions it hands on by reference (a token in the graph)
    handed: tuple = ()  # the sources it is the last to read: dropped from the frame as it takes them


class SubclassSpec(NamedTuple):
    """How to rebuild a traceable wrapper subclass (DTensor, a user's) from its inner tensors:
    `type.__tensor_unflatten__` with the metadata its `__tensor_flatten__` gave at trace time."""

    type: type
    names: tuple  # its inner tensors' attribute names, in the order they are passed
    consts: tuple  # (attribute name, object) per inner attribute that is not a tensor (DTensor's mesh)
    meta: Any
    size: tuple  # its outer size and stride
    stride: tuple

    @classmethod
    def of(cls, t) -> tuple["SubclassSpec", list]:
        """(t's spec, its inner tensors)."""
        names, meta = t.__tensor_flatten__()
        attrs = [(n, getattr(t, n)) for n in names]
        inner = [x for _, x in attrs if isinstance(x, torch.Tensor)]
        spec = cls(
            type(t),
            tuple(n for n, x in attrs if isinstance(x, torch.Tensor)),
            tuple((n, x) for n, x in attrs if not isinstance(x, torch.Tensor)),
            meta,
            tuple(t.shape),
            tuple(t.stride()),
        )
        return spec, inner

    def rebuild(self, inner):
        return self.type.__tensor_unflatten__(dict(zip(self.names, inner)) | dict(self.consts), self.meta, self.size, self.stride)


class SubclassUnpack(NamedTuple):
    """What an unpack hook returned that is a traceable wrapper subclass (a DTensor a checkpoint
    recomputed), learned from an eager backward (NOTE [Unpacked tensor subclasses],
    nodes/saved_tensors.py): unpacked in the graph as its inner tensors, rebuilt there."""

    spec: SubclassSpec
    inner: tuple  # (shape, dtype, device, dim order) per inner tensor
    key: tuple  # what the graph bakes in, by value (InGraph.subclass); the inner shapes are sizes

    @property
    def dim(self) -> int:
        return sum(len(shape) for shape, _, _, _ in self.inner)


class HookedTensor(NamedTuple):
    """A saved tensor unpacked in the graph by its hook (Collected.hooks; the UNPACK call's)."""

    hook: Any
    packed: Any
    learned: Any  # its LearnKey where what the hook returns was learned (checked at replay), else None
    subclass: "SubclassUnpack | None" = None  # NOTE [Unpacked tensor subclasses] (nodes/saved_tensors.py)


class CallHow(enum.IntEnum):
    """What the native helper runs for a call of a kind (native/values.h `enum CallHow`); the
    kinds it does not take run in Python (calls/kernel.py)."""

    PYTHON = -1
    TENSOR_PRE_HOOKS = 0
    PRE_HOOKS = 1
    POST_HOOKS = 2
    NODE = 3
    ACCUMULATE = 4
    HOOKED_ACCUMULATE = 5


class SlotKind(NamedTuple):
    """One kind of call, as its node family defines it (nodes/__init__.py SLOT_KINDS: the one
    table the trace, the passes, the call's kernel and the native helper follow)."""

    name: str  # Slot.kind
    family: str  # the node family whose call it is
    # how the call's kernel runs it: (capture, node, args, mask, metas, hooks, steal) -> its outputs
    run: Callable
    native: CallHow = CallHow.PYTHON  # what the native helper runs for it
    stage: int = -1  # where in its node's steps it runs (GraphWalk.hooks_added); -1: no hooks check
    accumulates: bool = False  # hands a grad to AccumulateGrad; returns nothing
    completes_node: bool = False  # eager has applied (and released) node `at` when it runs (NOTE [A backward that raised part way])
    reads_saved: bool = True  # may read saved tensors (NOTE [Saved tensors freed as eager frees them])
    shares_args: bool = True  # what else in the graph reads its arguments is recorded (Slot.shared)
    resumable: bool = False  # a run may stop at it (NOTE [A call output not as traced])
    ordering_args: bool = False  # its arguments only order it: no grad of its is kept by it
    new_grads_go_nowhere: bool = False  # an output where the trace had None is dropped, not an error
    what: str = ""  # how its errors name it ("" : "<kind> of <node>")


class PackageSlot(NamedTuple):
    """Where a graph's compiled package lies and the key of its HMAC (cache/disk.py package_slot;
    NOTE [Compiled graphs loaded without inductor], compile/package.py)."""

    path: str
    key: bytes


class ResumePoint(NamedTuple):
    """Where a graph's run can stop at a call and go on in eager's order (NOTE [A call output
    not as traced], capture/resume.py): what the trace held when it made the call, by the names
    of the graph's nodes that hold it."""

    slot: int
    node: int  # the node in whose step the call runs
    kind: str  # a resumable slot kind (hooks or an opaque node): the step goes on after it
    # the grads waiting for later nodes: (node, input_nr, value's name, definedness) each;
    # definedness None (defined), or ((flag's name, position), ...): defined iff any is set
    frontier: tuple
    n_result_calls: int  # the trace's results made before the call (Plan.result_calls)
    results: tuple  # (result index, name) of those results and their flags
    # the names of the graph values above, in the order the call takes them as its last
    # `Slot.n_resume` arguments (the kernel hands them to ResumeHere)
    values: tuple = ()
    # an UNPACK call's: (hooked saved tensor, name) per one its node unpacked before it (the
    # node's formula, resumed, gets them again; the grads entering the node are in `frontier`)
    unpacked: tuple = ()


@dataclass(frozen=True)
class Plan:
    """How to run and apply one captured graph (part of its cache entry)."""

    slots: tuple  # a Slot per opaque call
    accumulate: tuple  # (node index, result index, flag result index or -1), applied after the graph
    captured: tuple  # (result index or -1, flag result index or -1) per grad() input
    opaque: tuple  # (node index, node name, reason)
    num_results: int
    # create_graph=True: per graph result, whether eager's would require grad (NOTE [create_graph])
    differentiable: tuple | None = None
    # NOTE [Saved tensors freed as eager frees them]: eager frees a node's saved tensors
    # right after it runs. A hit hands them to a boxed graph, which frees each at its last
    # use, once the nodes' saved variables let go of them too. A call that may read saved
    # tensors -- an opaque node its own, a hook on a node that has any (`grad_fn._saved_*`,
    # `ctx.saved_tensors`) that node's and those of the nodes eager runs after it -- needs
    # them held until it ran. So a node's saved variables are freed right after the last
    # such call eager runs at or before that node, or before the graph when there is none:
    # (slot, node indices) per call, in `releases` (slot -1: before the graph; no entry at
    # all: every node's before the graph). AccumulateGrad, hooks on it (a leaf's
    # tensor hooks, DDP's), modules' full backward hooks (on BackwardHookFunction, which
    # saves nothing) and unpack hooks are taken to read none. With a tensor hook on every activation, each
    # layer's activations then live one layer longer than in eager, not to the graph's end
    releases: tuple = ()
    # (slot, lifted indices) per call that checks saved tensors read after it
    watch: tuple = ()
    # (slot, node indices) per call after which the ctx attributes of those custom Function
    # nodes (traced, so read when the backward started) are checked: a hook may rebind one
    ctx_checks: tuple = ()
    # create_graph=True: the AccumulateGrad nodes whose leaf's tensor hooks run as their grad is
    # applied, after the graph (NOTE [A leaf's hooks under create_graph], capture/create_graph.py)
    leaf_hooks: tuple = ()
    # the resume points and, per result the trace made (in its order), (result index, flag
    # index), -1 for none (NOTE [A call output not as traced], capture/resume.py)
    resume: tuple = ()
    result_calls: tuple = ()
    # (result index, SubclassSpec) per result that is a tensor subclass: its inner tensors are
    # the results from that index on, rebuilt before the results are applied
    # (docs/design/subclasses.md section 4)
    wrapped: tuple = ()
    # the lifted indices of tensor subclasses: the graph reads their inner tensors, not them, and
    # gets an empty tensor there (replay/run.py stand_in), never the subclass itself, which a
    # backend would desugar again (AOTAutograd: per call)
    stand_ins: tuple = ()
    # NOTE [Values passed by reference] (nodes/references.py): (result index, source) per result
    # that is a token of a value a call handed on by reference: the value replaces it
    by_reference: tuple = ()
    # the lifted indices of values held by reference: the graph gets an empty tensor there, the
    # calls given it the value (source ("lifted", index))
    held: tuple = ()

    @functools.cached_property
    def release_after(self) -> dict | None:
        """`releases` by slot, without the nodes freed before the graph."""
        return {slot: idxs for slot, idxs in self.releases if slot >= 0} or None

    @functools.cached_property
    def steals(self) -> bool:
        """Whether an ACCUMULATE call may hand AccumulateGrad the graph's own buffer
        (NOTE [Stealing a fresh grad], nodes/accumulate.py): only such a call is ever `fresh`."""
        return any(slot.fresh for slot in self.slots)


# NOTE [Boxed graphs free their inputs]
# AOTAutograd's usual entry point is `forward(*args)`: the argument tuple keeps
# every input alive until the graph returns, so the saved activations of the
# whole backward are alive at once. For a module wrapped in dynamo's GmWrapper
# (how torch compiles graphs with list inputs, its own compiled autograd
# included) it returns `forward(args: list)`, which empties the list; the
# compiled code then drops each input after its last use, and the backward's
# memory falls as it runs, like eager's. Callables marked BOXED take the list.
BOXED = "_compiled_autograd_boxed"
