"""The one opaque operator a captured graph may contain, and its replay context.

NOTE [Opaque calls]
Hooks (tensor, pre, post, retain_grad, post-accumulate-grad), nodes that cannot
be traced, and AccumulateGrad when something in the graph may observe `.grad`
run on real tensors in the middle of the compiled graph. Each such point is one
`compiled_autograd::call(slot, args, ...)`:
  * `slot` names what to run: a row of the entry's slot table, `(kind, node)`;
    the objects to run (hook functions, nodes) come from the current backward's
    collected graph, so a new hook closure each step is not a new graph.
  * the output metadata rides along as arguments, so the fake implementation
    needs no side table and every backend (aot_eager, inductor) can trace it.
  * the operator is registered as an ORDERED effect: no backend may reorder or
    drop it, so hooks observe what they would observe in eager.
Outputs are owned by the graph (NOTE [Outputs the graph owns]) and in the layout it
was traced with (NOTE [Layouts of call outputs]); a real output whose shape, dtype
or device differs from what the graph was traced with raises instead of being
misread by compiled code.

NOTE [Layouts of call outputs]
The trace decides each call output's strides before anything runs (make_fx turns
a formula's `reshape` into a `view` on the strides it sees), so what a hook, an
opaque node or an unpack hook returns in another layout must be copied into the
traced one. The values are the same, but a kernel after it may sum in another
order than eager's on the tensor eager passed on (a bias grad `g.sum(0)` of a
transposed grad: 1e-6 off), so with eager's kernels the result is no longer
bitwise eager's. So each output is traced in the layout it will most likely have,
always dense (a permutation of a contiguous tensor: a copy into it is exact):
  * a hook's result: its grad's layout (as `empty_like` lays it out); a hook that
    returns its grad, or computes on it elementwise, keeps it;
  * an unpack hook's: `save_on_cpu` unpacks its contiguous copy; what a checkpoint
    recomputes, or another hook returns, is learned from an eager backward of the
    graph, as its shape is (NOTE [Unpack metadata learned from the last backward],
    nodes/saved_tensors.py), and kept per graph position for other sizes;
  * an opaque node's: contiguous.
At replay, an output in another layout is copied into the traced one
(`stats().layout_copies`), and the dense layout it had is remembered for its
graph and call (cache/learned.py LAYOUTS): that graph is dropped and the next
backward captures again in those layouts, after which it is bitwise eager's again
(a few times per graph at most: a hook whose layout changes every step keeps its
graph and its copies). On a graph's first run the copy is not made: the run stops
at that call and the backward goes on in eager's order from it (NOTE [A call
output in another layout on a graph's first run], capture/resume.py). So only a
backward in which a hook's layout changed after its graph's first run may differ
from eager in the last bits, counted.

NOTE [Outputs the graph owns]
A compiler may treat an operator's outputs as its own buffers: inductor reuses
a dead one in place (`buf3 = buf2; del buf2  # reuse`, then a kernel writes
into buf3). What a hook or node returns may be memory someone else still
holds: the hook's input, a tensor its closure keeps, a saved tensor, another
view of a storage. Writing into it would change the user's tensor and, on the
next backward, the gradients. So an output is handed to the graph as is only
when nothing but the call's result refers to it (one Python reference, one
TensorImpl reference, one tensor on its storage); otherwise it is copied.
One exception, the common one: a hook that returns its grad unchanged (a
logging hook returning None, a module hook passing grads through) gives back
the call's own input. When nothing else in the graph reads that input
(`Slot.shared`) and the compiled code never writes into a call's inputs (the
eager graph and aot_eager run functional ops; our inductor lowering keeps the
inputs of a KEEPS_INPUTS call from reuse), the output is that input: no copy.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Optional

import torch

from ..compile import torch_patches
from ..values import (  # the call protocol; re-exported for the graphs' code and the native helper
    ReplayFrame,
    _DTYPES,
    _DTYPE_CODE,
    _DEVICE_TYPES,
    device_code,
    _device,
    CallArgs,
    DEFINEDNESS,
    KEEPS_INPUTS,
    FREED_NOT_REUSED,
    DIRECT,
    HANDS_OVER,
    PASSES_SHIFT,
    TENSOR_PRE_HOOKS,
    PRE_HOOKS,
    POST_HOOKS,
    NODE,
    ACCUMULATE,
    UNPACK,
    HOOKED_ACCUMULATE,
    ACCUMULATES,
    _STAGE,
    OutputMeta,
    observed_layout,
    dim_order,
    dense_order,
    encode_meta,
    decode_meta,
)
from ..errors import ResumeHere
from .checks import _check_ctx, _check_versions, _hooks_added_error, _shared_modified_error, _still_empty_error


class _Replay(threading.local):
    def __init__(self):
        self.stack: list = []  # (capture, slots, autograd keys excluded, hooks, steal, keep) of the backwards running on this thread
        self.tasks: list = []  # the graph task id each of them runs its calls in
        self.last: list = []  # the slot of the last call each of them ran (None: none yet)
        # the slots at which each of them may stop, on a graph's first run (NOTE [A call output
        # in another layout on a graph's first run], capture/resume.py)
        self.resumable: list = []


_replay = _Replay()


# A custom op's kernel runs below autograd (the autograd dispatch keys are
# excluded), and a dispatch mode's handler that calls the op again runs with more
# keys excluded (AOTAutograd's first-call aliasing check: Conjugate, Negative,
# ZeroTensor...; a hook's `conj()` was a no-op there). Hooks and nodes we call
# must see the dispatch state of the backward call instead: a hook may run
# autograd itself (e.g. a nested grad()), or use lazily conjugated tensors.
_DISPATCH_KEYS = [getattr(torch._C.DispatchKey, name) for name in torch._C.DispatchKey.__members__]


def _set_exclude_set(want, current) -> list:
    """Make the thread's excluded dispatch keys `want`; return what undoes it."""
    undo = []
    for k in _DISPATCH_KEYS:
        try:
            if want.has(k) != current.has(k):
                torch._C._dispatch_tls_set_dispatch_key_excluded(k, want.has(k))
                undo.append((k, current.has(k)))
        except RuntimeError:  # an alias key: not a single key to set
            continue
    return undo


class replaying:
    """Context of one compiled graph run: where its slots resolve."""

    def __init__(self, capture, slots, hooks=(), steal=None, keep=False, versions=None, ctx=None, releases=None, observed=None,
                 resumable=None):
        self.task = torch._C._current_graph_task_id()  # in_graph_task's, when calls run
        # hooks: (unpack_hook, packed) per hooked saved tensor, for UNPACK slots;
        # steal: None, or the graph inputs' storages when ACCUMULATE calls may
        # steal a fresh grad (NOTE [Stealing a fresh grad]); keep: the compiled code
        # never writes into a call's inputs, so an output may be one (NOTE [Outputs the
        # graph owns])
        # versions: per slot that checks saved tensors read after it, their versions when
        # the backward started (NOTE [Hooks may change what the graph reads]); ctx: per slot
        # after which custom Functions' ctx attributes are checked, (ctx, its attributes
        # when the backward started) (Plan.ctx_checks); releases: per slot, the nodes whose
        # saved variables are freed after it (NOTE [Saved tensors freed as eager frees them])
        # (the dispatch keys the backward call excluded: a call runs its hooks with them)
        # observed: (slot, output) -> the layout a call's output had where it was not the
        # traced one (NOTE [Layouts of call outputs])
        self.frame = ReplayFrame(capture, slots, torch._C._dispatch_tls_local_exclude_set(), hooks, steal, keep, versions, ctx, releases, observed)

        self.failed_at = None  # the slot of the last call started, when the graph raised
        self.resumable = resumable or ()

    def __enter__(self):
        _replay.last.append(None)
        try:
            _native().push_replay(self.frame, _replay.last)
        except BaseException:  # nothing pushed: leave both stacks as they were
            _replay.last.pop()
            raise
        _replay.stack.append(self.frame)
        _replay.tasks.append(self.task)
        _replay.resumable.append(self.resumable)
        return self

    def __exit__(self, exc_type, *exc):
        _native().pop_replay()
        _replay.stack.pop()
        _replay.tasks.pop()
        _replay.resumable.pop()
        last = _replay.last.pop()
        if exc_type is not None:
            self.failed_at = last


# NOTE [Engine queries from hooks]
# Hooks run inside a one-node eager graph task (graph_task.in_graph_task), so what
# the engine answers about "the current backward" is about that task, not ours.
# torch.autograd.graph.register_multi_grad_hook(mode="all") counts the calls it
# waits for with torch._C._will_engine_execute_node: every node but that one
# node read as "will not run", so it waited for none and never called its
# function. While a graph of ours runs, that query (from its own graph task: not
# a nested eager backward's) is answered from the captured graph instead.
def _will_engine_execute_node(node):
    """The captured graph's answer, from its own graph task; None: eager's answer (the
    patch of torch._C._will_engine_execute_node is compile/torch_patches.py's)."""
    if _replay.stack and _replay.tasks[-1] != -1 and _replay.tasks[-1] == torch._C._current_graph_task_id():
        return _replay.stack[-1].capture.will_execute(node)
    return None


torch_patches.engine_query = _will_engine_execute_node


def _call(
    slot: int,
    args: list[Optional[torch.Tensor]],
    meta: list[int],
    flags: int,
) -> list[torch.Tensor]:
    """The op's kernel, as the dispatcher runs it (below autograd)."""
    return _run_call(slot, args, meta, flags)


def _run_call(slot, args, meta, flags) -> list[torch.Tensor]:
    """One call of a replayed graph, in the backward call's dispatch state."""
    frame = _replay.stack[-1]
    capture, slots, outside, hooks, steal, keep = frame.capture, frame.slots, frame.outside, frame.hooks, frame.steal, frame.keep
    versions, ctx, releases, observed = frame.versions, frame.ctx, frame.releases, frame.observed
    s = slots[slot]
    kind, node, mask, in_flags, fresh, n_after, shared, n_watch = s.kind, s.node, s.mask, s.in_flags, s.fresh, s.n_after, s.shared, s.n_watch
    passed = ()
    if flags >> PASSES_SHIFT:  # graph inputs read after this call: returned, so read after it
        n = flags >> PASSES_SHIFT
        passed, args = args[-n:], args[:-n]
    watched = ()
    if n_watch:  # saved tensors read after this call, checked after it
        watched, args = args[-n_watch:], args[:-n_watch]
    if n_after:  # only there to order the call (NOTE [Hooks may change what the graph reads])
        args = args[:-n_after]
    last = _replay.last[-1]
    _replay.last[-1] = slot
    if last is None or slots[last].at != slots[slot].at:
        # the engine runs each node in the backward's own thread-local state: a hook that
        # left grad mode changed (`torch.set_grad_enabled(True)` as a statement) changed it
        # for the rest of its node only (an unpack hook there sees it)
        if torch.is_grad_enabled() != capture.grad_mode:
            torch._C._set_grad_enabled(capture.grad_mode)
    before = [args[i]._version if args[i] is not None else 0 for i in shared]
    if in_flags:
        # the last argument says which arguments are defined: an undefined grad
        # reached the graph as zeros (NOTE [Undefined grads of opaque nodes]),
        # the hook or node gets None, as in eager
        *args, defined = args
        args = [a if d else None for a, d in zip(args, defined.tolist())]
    inside = torch._C._dispatch_tls_local_exclude_set()
    undo = _set_exclude_set(outside, inside) if inside != outside else ()
    try:
        if kind in ACCUMULATES:
            outs = accumulate(capture, node, args, steal if fresh else None, kind == HOOKED_ACCUMULATE)
        else:
            keeps = keep and flags & KEEPS_INPUTS
            # a grad a hook keeps (`seen.append(g)`) must not become `.grad` as it is: eager's
            # AccumulateGrad sees the hook's reference and copies (NOTE [Stealing a fresh grad])
            counts = [(a, sys.getrefcount(a)) for a in args if a is not None] if steal is not None and kind != UNPACK else ()
            outs = _run_slot(capture, slot, kind, node, mask, args, meta, flags, hooks, shared if keeps else None, observed,
                             slot in _replay.resumable[-1])
            for a, n in counts:
                if sys.getrefcount(a) - sum(o is a for o in outs) > n:
                    steal.add(a)
        check_hooks_added(capture, kind, node)
        if watched:
            _check_versions(watched, versions[slot])
        if ctx and slot in ctx:
            _check_ctx(ctx[slot])
        for i, v in zip(shared, before):
            if args[i] is not None and args[i]._version != v:
                _shared_modified_error(kind, capture, node)
        if releases and slot in releases:
            capture.release_nodes(releases[slot])
        if passed:  # as the call leaves them; a user's backend may reuse an output's buffer: a copy
            for t in passed:
                if t.numel() and t.untyped_storage().nbytes() == 0:
                    _still_empty_error(kind, capture, node)
            outs = [*outs, *(passed if keep else [t.clone() for t in passed])]
        return outs
    finally:
        for k, excluded in undo:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, excluded)


def check_hooks_added(capture, kind, node) -> None:
    """Raise where what a call ran gave hooks to a node the graph has no call for."""
    if kind != UNPACK and capture.hooks_added(node, _STAGE[kind]):
        _hooks_added_error(kind, capture, node)


def _run_slot(capture, slot, kind, node, mask, args, meta, flags, hooks, shared=None, observed=None, stop=False):
    if kind == UNPACK:
        from ..nodes.saved_tensors import unpack

        pair, hooks[node] = hooks[node], None  # unpacked once, as eager does: the packed value can go
        if pair is None:
            raise RuntimeError("compiled_autograd: a saved tensor was unpacked twice by one graph")
        hook, packed, learned = pair
        del pair
        outs = [unpack(hook, packed)]
        del hook, packed
        if learned is not None:
            from ..nodes.saved_tensors import LEARNED

            expected = decode_meta(meta)[0]
            LEARNED.check(learned, outs[0], expected.shape, expected.dtype, expected.device)
    elif kind == TENSOR_PRE_HOOKS:
        outs = capture.call_tensor_pre_hooks(node, args)
    elif kind == PRE_HOOKS:
        outs = capture.call_pre_hooks(node, args)
    elif kind == POST_HOOKS:
        n = len(mask)
        outs = capture.call_post_hooks(node, args[:n], args[n:])
    elif kind == NODE:
        outs = capture.call_node(node, args)
    else:
        raise AssertionError(f"unknown slot kind {kind}")
    metas = decode_meta(meta)
    if stop:
        _stop_if_relaid(slot, mask, outs, metas, observed, args)
    keep = () if shared is None else [a for i, a in enumerate(args) if a is not None and i not in shared]
    return _conform(kind, capture, node, mask, outs, keep, metas, flags, slot, observed)


def _stop_if_relaid(slot, mask, outs, metas, observed, args) -> None:
    """On a graph's first run, an output in another layout than traced stops the run before
    it is copied (NOTE [A call output in another layout on a graph's first run],
    capture/resume.py); what the call returned goes with it, as it came."""
    outs = list(outs) + [None] * (len(mask) - len(outs))
    positions = [i for i, m in enumerate(mask) if m]
    relaid = False
    for k, (i, m) in enumerate(zip(positions, metas)):
        o = outs[i]
        if o is None or list(o.shape) != list(m.shape) or o.dtype != m.dtype or o.device != m.device:
            continue  # (_conform raises for what is not a layout)
        if not m.has_layout(o.resolve_conj().resolve_neg()):
            relaid = True
            if observed is not None:
                observed[(slot, k)] = observed_layout(o)
    if relaid:
        raise ResumeHere(slot, [o if m else None for o, m in zip(outs, mask)], list(args))


def input_storages(args):
    """The storages of a graph's tensor inputs, by identity (NOTE [Stealing a fresh grad]):
    the native helper's StorageSet, whose weak references pin their StorageImpls for the
    graph's run (a boxed graph frees inputs as it goes; a new grad may get a freed input's
    memory, never its StorageImpl). `t in storages`; `storages.add(t)`: never steal t's
    memory (a hook kept a reference to it)."""
    from .. import native

    return native.load().StorageSet([t for t in args if isinstance(t, torch.Tensor)])


def accumulate(capture, node, args, steal, hooked=False):
    """NOTE [Stealing a fresh grad]
    AccumulateGrad runs inside the graph when hooks or opaque nodes could
    observe `.grad` (DDP's reducer, module hooks). Eager's AccumulateGrad takes
    the incoming grad as `.grad` without a copy when nothing else refers to it
    (it "steals" it); here the graph's code still refers to it, so it would copy
    every parameter's gradient (a 4 MB copy, and fresh pages to fault in, per
    weight of the D=1024 MLP: 1.3-1.8x eager's backward with such hooks, where
    it is 0.8-1.0x without). So AccumulateGrad gets a new tensor on the grad's
    memory that nothing else refers to, and applies its own rule to it (steal
    if the layout contract holds, else copy), as eager decides for the grad its
    engine hands it, when that memory is the graph's own and nothing writes
    into it afterwards:
      * the traced graph computed it (an op's result or a view of one, not a
        view of a graph input) and reads it nowhere else (a hook may change
        `.grad` in place; eager copies a grad its engine still holds for
        another node): `fresh`, trace._mark_fresh_grads;
      * at run time its storage is none of the graph inputs' (`steal`: those
        storages, by identity; a compiler that removes no-ops could hand over
        an input), nor of a tensor a hook kept (its reference count rose across
        the hook's call, `input_storages(...).add`: a logging hook storing its grad;
        eager's AccumulateGrad sees that reference and copies);
      * nothing in the compiled code writes into it afterwards: the eager
        graph and aot_eager run functional aten ops; inductor reuses a dead
        buffer for a later result (`buf3 = buf1; del buf1  # reuse`), so the
        call is marked in the graph (its flags have HANDS_OVER) and our
        lowering of it (backends._register_inductor_lowering) puts the grad's
        buffer in inductor's never-reuse set. (Making it a graph output would
        stop the reuse too, but keep every new grad alive to the end of the
        graph when it is added into an existing `.grad`.) A user's backend
        gets the copy, as torch's built-in copies every such grad.

    NOTE [A leaf's hooks and its accumulation in one call]
    A leaf's tensor hooks (`param.register_hook`: logging, clipping, DDP-style
    bucketing) run right before its AccumulateGrad, in the same step of the
    engine, and what they return is what it accumulates. Two calls cost two
    trips out of the compiled code and back (dispatch, the frame, conforming the
    hooks' result to the graph's expectations), ~80 us per hooked parameter
    against eager's ~3 us; so a leaf whose grad is always defined, and whose
    AccumulateGrad node has no pre or post hooks of its own (those see what the
    tensor hooks returned), gets one call (`hooked`,
    GraphCapture.accumulate_graph_grad), which hands the hooks' result to
    AccumulateGrad as the engine does: nothing of the graph sees it. The hooks
    get the grad as the lone call got it: a tensor nothing else refers to on
    the graph's buffer when that may be stolen (above), so a hook that keeps it
    raises its reference count and AccumulateGrad copies, as eager's does."""
    grad, defined = args[0], (args[1] if len(args) > 1 else None)
    if grad is None or (defined is not None and not bool(defined)):
        return []
    # (the new tensor on the grad's memory is made there: no Python object refers to it)
    capture.accumulate_graph_grad(node, grad, hooked, steal)
    return []


call = torch.library.custom_op("compiled_autograd::call", _call, mutates_args=())
# The kernel is registered once more, directly: custom_op's wrapper of it checks that no
# output aliases an input, which a hook that returns its grad unchanged may do here (NOTE
# [Outputs the graph owns]: only where that is safe), and costs a few microseconds a call.
_lib = torch.library.Library("compiled_autograd", "FRAGMENT")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # "Overriding a previously registered kernel"
    _lib.impl("call", _call, "CompositeExplicitAutograd", allow_override=True)


_op = torch.ops.compiled_autograd.call.default


def _fast_path() -> bool:
    """Whether a call can skip the dispatcher's way to the kernel: grad mode off and no
    dispatch mode (a trace) active, as when a compiled graph runs."""
    return not torch.is_grad_enabled() and torch._C._len_torch_dispatch_stack() == 0


def _call_at_autograd(slot, args, meta, flags):
    """The kernel at the Autograd key. A compiled graph calls the op with grad mode off and no
    dispatch mode active: the kernel runs there and then, skipping custom_op's Python
    autograd wrapper and its redispatch below autograd (about 20 us of a call's ~120). The
    call has no derivative (graphs under create_graph have no calls: runtime.py), so
    otherwise, and while a trace (make_fx's proxy mode, fake tensors, functionalization)
    is active, it goes on below autograd as any op does."""
    if _fast_path():
        return _run_call(slot, args, meta, flags)
    with torch._C._AutoDispatchBelowAutograd():
        return _op(slot, args, meta, flags)


def call_direct(slot, args, meta, flags):
    """The call without the dispatcher (its boxing of the arguments costs ~10 us), for the
    graphs that run as Python code we generate (the eager backend, aot_eager's graph:
    compile/backends.py): the same kernel, where the dispatcher would run it directly."""
    if _fast_path():
        return _run_call(slot, args, meta, flags)
    return _op(slot, args, meta, flags)


with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # "Overriding a previously registered kernel"
    _lib.impl("call", _call_at_autograd, "Autograd", allow_override=True)

# The name inductor's generated Python code calls a call by (backends._register_inductor_lowering):
# the direct call, reachable from the `torch` every such module imports
_op._compiled_autograd_direct = call_direct
DIRECT_KERNEL_NAME = "torch.ops.compiled_autograd.call.default._compiled_autograd_direct"

# NOTE [Calls in the helper]
# A call out of compiled code costs its Python: the frames of call_direct,
# _run_call, _run_slot and _conform, slicing the arguments, the grad-mode and
# dispatch-key checks, the checks after it. That was most of a hook's cost
# against eager (a clamping hook on a parameter: ~12 us a call against eager's
# ~5 us; a hook on an activation ~22 us more than eager). So the compiled code
# calls the native helper's call_direct, which takes AccumulateGrad, hook and
# opaque-node calls through the same steps as _run_call, in C++, and raises
# through the same functions here (_hooks_added_error, _check_versions,
# _check_ctx, _shared_modified_error, _conform for what it rejects): the
# replay's frame is pushed to the helper as well (replaying). An unpack call,
# a call off the fast path (grad mode on, a dispatch mode active), or one whose
# thread excludes other dispatch keys than the backward call did, goes to
# call_direct or _run_call here.
direct = call_direct  # what compiled code calls: the helper's, once loaded (_native)
_native_module = None


def _native():
    """The native helper, with its direct call installed (NOTE [Calls in the helper])."""
    global _native_module, direct
    if _native_module is None:
        from .. import native

        mod = native.load()
        _install_calls(mod)
        direct = _op._compiled_autograd_direct = mod.call_direct
        _native_module = mod
    return _native_module


def _install_calls(mod, run_call=None) -> None:
    """Give the helper's direct call the Python it hands other calls to (`run_call`:
    _run_call, or a test's wrapper of it)."""
    mod.install_calls(
        {
            "call_direct": call_direct,
            "run_call": run_call or _run_call,
            "kinds": [TENSOR_PRE_HOOKS, PRE_HOOKS, POST_HOOKS, NODE, ACCUMULATE, HOOKED_ACCUMULATE],
            "dtypes": _DTYPES,
            "device_types": _DEVICE_TYPES,
            "conform_error": _conform_error,
            "observed_layout": observed_layout,
            "conformed": lambda meta, k, t: decode_meta(meta)[k].conformed(t),
            "check_versions": _check_versions,
            "check_ctx": _check_ctx,
            "hooks_added_error": _hooks_added_error,
            "shared_modified_error": _shared_modified_error,
            "still_empty_error": _still_empty_error,
        }
    )


def _register_aliasing_check_exemption():
    """AOTAutograd runs a compiled function's first call under a mode that checks that no custom
    op's output aliases its input (torch._functorch.config.check_custom_op_aliasing; an error
    where the environment sets CI, a warning elsewhere). A call that hands its grad back does
    alias, where that is safe (NOTE [Outputs the graph owns]), so under that mode the call runs
    unchecked; every other op is still checked."""
    import torch._dynamo  # noqa: F401  (imported first, runtime_wrappers' import is circular)

    try:
        from torch._functorch._aot_autograd.runtime_wrappers import _AnalyzeCustomOpInputOutputMode
    except ImportError:  # pragma: no cover - another torch
        return

    def unchecked(mode, func, types, args, kwargs):
        return func(*args, **(kwargs or {}))

    call.register_torch_dispatch(_AnalyzeCustomOpInputOutputMode, unchecked)


_register_aliasing_check_exemption()


@call.register_fake
def _call_fake(slot, args, meta, flags):
    outs = [m.empty() for m in decode_meta(meta)]
    if flags & DEFINEDNESS:
        outs.append(torch.empty(len(outs), dtype=torch.bool))
    if flags >> PASSES_SHIFT:  # returned as they are: same geometry
        outs += [torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device) for a in args[-(flags >> PASSES_SHIFT) :]]
    return outs


def _register_effect():
    try:
        from torch._library.effects import EffectType

        torch.library._register_effectful_op("compiled_autograd::call", EffectType.ORDERED)
    except Exception:  # pragma: no cover - older torch
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(torch.ops.compiled_autograd.call.default, _EffectType.ORDERED)


_register_effect()
# graph passes that only know FX's own notion of purity must not drop it either
torch.fx.node.has_side_effect(torch.ops.compiled_autograd.call.default)


def _conform(kind, capture, node, mask, outs, keep, metas, flags, slot=None, observed=None):
    """Real outputs -> the defined, non-aliasing tensors, in the traced layouts, the graph expects.

    `mask[i]` says whether output i was defined when the graph was traced;
    `metas` describes those outputs, in order. With flags (opaque nodes and
    hooks) a missing grad becomes zeros and a False flag, so the graph knows
    it is undefined. A grad where none was expected: from an opaque node it
    goes nowhere (its edge is not in the graph); a hook that makes a None grad
    defined cannot be followed (the graph has no place for it) and raises.
    An output in another layout than traced is copied into it, and `observed`
    records the layout it had (NOTE [Layouts of call outputs])."""
    # `outs` (the list the hook or node returned) is taken over: its entries are
    # cleared as they are read, so that a private tensor has no reference left but ours
    outs.extend([None] * (len(mask) - len(outs)))
    if kind not in (NODE, UNPACK) and any(o is not None and not m for o, m in zip(outs, mask)):
        raise RuntimeError(
            f"compiled_autograd: {kind.replace('_', ' ')} of {capture.node_name(node)} returned a gradient "
            "where the backward had None; the compiled graph cannot follow"
        )
    result, present = [], []
    positions = [i for i, m in enumerate(mask) if m]
    for k, (i, m) in enumerate(zip(positions, metas)):
        o, outs[i] = outs[i], None
        if o is None:
            present.append(False)
            result.append(m.empty().zero_())
            continue
        present.append(True)
        if list(o.shape) != list(m.shape) or o.dtype != m.dtype or o.device != m.device:
            what = "the unpack hook of a saved tensor" if kind == UNPACK else f"{kind.replace('_', ' ')} of {capture.node_name(node)}"
            raise RuntimeError(
                f"compiled_autograd: {what} returned a tensor of {tuple(o.shape)}/{o.dtype}/{o.device} "
                f"where the graph was traced with {tuple(m.shape)}/{m.dtype}/{m.device}"
            )
        # the graph was traced with a plain tensor: no lazy conjugate or negative bit
        o = o.resolve_conj().resolve_neg()
        if not m.has_layout(o):
            if observed is not None:
                observed[(slot, k)] = observed_layout(o)
            o = m.conformed(o)
        # the references of a private tensor: `o` and getrefcount's argument; or the
        # call's own input, which nothing else in the graph reads (`keep`)
        if (sys.getrefcount(o) > 2 or not _sole_owner(o)) and not any(o is a for a in keep):
            o = o.clone()
        result.append(o)
    if flags & DEFINEDNESS:
        result.append(torch.tensor(present, dtype=torch.bool))
    return result


def _conform_error(kind, capture, node, mask, outs, meta, flags):
    """_conform's error for outputs the native helper's conform rejected."""
    _conform(kind, capture, node, mask, outs, (), decode_meta(meta), flags)
    raise AssertionError("compiled_autograd: the helper rejected outputs that _conform accepts")


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether t's TensorImpl and storage are referenced by t alone (no other
    at::Tensor, view, saved variable or detached alias)."""
    if t._use_count() != 1:
        return False
    try:
        storage = t.untyped_storage()
    except Exception:  # no storage to share (a subclass, a meta tensor)
        return False
    return torch._C._storage_Use_Count(storage._cdata) == 2  # t's and `storage`'s
