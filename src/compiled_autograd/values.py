"""What the stages hand each other, each defined once and read by name:
the walk's node rows; the call protocol between a captured graph and its
replay (`compiled_autograd::call`'s arguments, output layouts, slot kinds,
flags); the plan a capture hands the replay; how a compiled graph is called.

The native helper builds some of them as plain tuples in the field order given
here (its `GraphCapture.nodes()` makes NodeRows' tuples); nothing reads them by
position but the constructors below.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence, Union

import torch


BackendLike = Union[str, Callable]  # a registered backend's name, or a callable(gm, example_inputs) -> callable


class NodeKind(enum.IntEnum):
    """How the native walker classed a node (native/values.h `enum Kind`)."""

    GENERIC = 0  # implements torch's compiled-autograd interface: traced through apply_with_saved
    ACCUMULATE = 1  # AccumulateGrad
    PYNODE = 2  # a custom autograd.Function: its Python backward is traced
    OPAQUE = 3  # runs as is inside the graph (a C++ custom Function, ...)


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


# -- the call protocol (NOTE [Opaque calls], replay/calls.py) --------------------

# dtype <-> small int, for the operator schema
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32,
]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_DEVICE_TYPES = ["cpu", "cuda", "mps", "xpu", "meta", "hpu", "privateuseone"]


def device_code(device) -> int:
    d = torch.device(device)
    return _DEVICE_TYPES.index(d.type) * 1024 + (0 if d.index is None else d.index + 1)


@functools.lru_cache(maxsize=None)
def _device(code: int) -> torch.device:
    kind, index = divmod(code, 1024)
    return torch.device(_DEVICE_TYPES[kind]) if index == 0 else torch.device(_DEVICE_TYPES[kind], index - 1)



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
# (backends._register_inductor_lowering); code compiled before calls the op
DIRECT = 32
# an ACCUMULATE call whose grad AccumulateGrad may take as `.grad` (NOTE [Stealing a fresh
# grad]): inductor's lowering keeps its buffer from reuse (compile/backends.py)
HANDS_OVER = 64
# flags >> PASSES_SHIFT: how many of its last arguments the call also returns, as its last
# outputs (graph inputs read after it: NOTE [Hooks may change what the graph reads], capture/passes.py)
PASSES_SHIFT = 8

# slot kinds
TENSOR_PRE_HOOKS = "tensor_pre_hooks"
PRE_HOOKS = "pre_hooks"
POST_HOOKS = "post_hooks"
NODE = "node"
ACCUMULATE = "accumulate"
UNPACK = "unpack"  # a saved tensor's unpack hook (walk/collect.py, NOTE [Unpacking in the graph])
# a leaf's tensor hooks and its AccumulateGrad (NOTE [A leaf's hooks and its accumulation in one call])
HOOKED_ACCUMULATE = "tensor_hooks_and_accumulate"
ACCUMULATES = (ACCUMULATE, HOOKED_ACCUMULATE)  # the calls that hand a grad to AccumulateGrad
# where in its node's steps a call runs (GraphCapture.hooks_added)
_STAGE = {TENSOR_PRE_HOOKS: 0, PRE_HOOKS: 1, NODE: 2, POST_HOOKS: 2, ACCUMULATE: 2, HOOKED_ACCUMULATE: 0}


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


_LAYOUTS = [torch.strided, torch.sparse_coo]


def encode_meta(metas: Sequence[OutputMeta]) -> list:
    """The call's `meta` argument: per output, rank, dtype code, device code, layout code,
    shape, strides (the one encoding: the native helper's `decode_meta` reads the same)."""
    out: list = []
    for m in metas:
        out += [len(m.shape), _DTYPE_CODE[m.dtype], device_code(m.device), _LAYOUTS.index(m.layout), *m.shape, *m.strides]
    return out


def decode_meta(meta: Sequence) -> list[OutputMeta]:
    out, pos = [], 0
    while pos < len(meta):
        rank, dtype, device, layout = (int(v) for v in meta[pos : pos + 4])
        pos += 4
        shape, strides = list(meta[pos : pos + rank]), list(meta[pos + rank : pos + 2 * rank])
        out.append(OutputMeta(shape, _DTYPES[dtype], _device(device), strides, _LAYOUTS[layout]))
        pos += 2 * rank
    return out


class ReplayFrame(NamedTuple):
    """What the calls of one running graph resolve against (replay/calls.py `replaying`; the
    native helper reads it by values.h's field indices)."""

    capture: object  # the backward's collected graph (the native GraphCapture)
    slots: tuple  # the plan's Slots
    outside: object  # the dispatch keys the backward call excluded (calls run with them)
    hooks: object  # (unpack_hook, packed, learned key) per hooked saved tensor, for UNPACK calls
    steal: object  # None, or the graph inputs' storages when AccumulateGrad may steal (NOTE [Stealing a fresh grad])
    keep: bool  # the compiled code never writes into a call's inputs (NOTE [Outputs the graph owns])
    versions: object  # slot -> saved tensors' versions it checks (NOTE [Hooks may change what the graph reads])
    ctx: object  # slot -> custom Functions' ctx snapshots checked after it (Plan.ctx_checks)
    releases: object  # slot -> nodes whose saved variables are freed after it
    observed: object  # (slot, output) -> layout of an output copied into the traced one


# -- the plan of a captured graph --------------------------------------------------

class Slot(NamedTuple):
    """One opaque call of a graph (NOTE [Opaque calls], replay/calls.py)."""

    kind: str
    node: int  # index of the node (or hooked saved tensor, for UNPACK)
    mask: tuple  # per output: whether the graph was traced with it defined
    in_flags: bool  # its last argument says which arguments are defined
    # an ACCUMULATE call's grad is memory the graph made (NOTE [Stealing a fresh grad], replay/calls.py)
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

    @property
    def completes_node(self) -> bool:
        """Whether eager has applied (and, without retain_graph, released) node `at` when this
        call runs: its post hooks run after the node (NOTE [A backward that raised part way])."""
        return self.kind == POST_HOOKS


class ResumePoint(NamedTuple):
    """Where a graph's first run can stop at a call and go on in eager's order (NOTE [A call
    output in another layout on a graph's first run], capture/resume.py): what the trace held
    when it made the call, by the names of the graph's nodes that hold it."""

    slot: int
    node: int  # the node in whose step the call runs
    kind: str  # TENSOR_PRE_HOOKS, PRE_HOOKS, POST_HOOKS or NODE: the step goes on after it
    # the grads waiting for later nodes: (node, input_nr, value's name, definedness) each;
    # definedness None (defined), or ((flag's name, position), ...): defined iff any is set
    frontier: tuple
    n_result_calls: int  # the trace's results made before the call (Plan.result_calls)
    results: tuple  # (result index, name) of those results and their flags


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
    # the first run's resume points and, per result the trace made (in its order), (result
    # index, flag index), -1 for none (NOTE [A call output in another layout on a graph's
    # first run], capture/resume.py)
    resume: tuple = ()
    result_calls: tuple = ()
    # (result index, type, inner tensor names, inner non-tensors (name, object), flatten
    # metadata, outer size, outer stride) per result
    # that is a tensor subclass: its inner tensors are the results from that index on, rebuilt
    # before the results are applied (docs/design/subclasses.md section 4)
    wrapped: tuple = ()
    # the lifted indices of tensor subclasses: the graph reads their inner tensors, not them, and
    # gets an empty tensor there (replay/run.py stand_in), never the subclass itself, which a
    # backend would desugar again (AOTAutograd: per call)
    stand_ins: tuple = ()

    @functools.cached_property
    def release_after(self) -> dict | None:
        """`releases` by slot, without the nodes freed before the graph."""
        return {slot: idxs for slot, idxs in self.releases if slot >= 0} or None

    @functools.cached_property
    def steals(self) -> bool:
        """Whether an ACCUMULATE call may hand AccumulateGrad the graph's own buffer
        (NOTE [Stealing a fresh grad], replay/calls.py)."""
        return any(slot.kind in ACCUMULATES and slot.fresh for slot in self.slots)


# NOTE [Boxed graphs free their inputs]
# AOTAutograd's usual entry point is `forward(*args)`: the argument tuple keeps
# every input alive until the graph returns, so the saved activations of the
# whole backward are alive at once. For a module wrapped in dynamo's GmWrapper
# (how torch compiles graphs with list inputs, its own compiled autograd
# included) it returns `forward(args: list)`, which empties the list; the
# compiled code then drops each input after its last use, and the backward's
# memory falls as it runs, like eager's. Callables marked BOXED take the list.
BOXED = "_compiled_autograd_boxed"
