"""The kernel of `compiled_autograd::call` (NOTE [Opaque calls] in calls/__init__.py): one
call of a replayed graph, run as its slot kind's row says (nodes/__init__.py SLOT_KINDS), with
its outputs conformed to what the graph was traced with; and the frame of a running graph.

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
At run time, an output in another dense layout stops the graph at that call and
the backward goes on in eager's order from it (NOTE [A call output not as traced],
capture/resume.py), as a tensor subclass where the graph has a plain tensor does;
the layout it had is remembered for its graph and call (nodes/learned.py
LEARNED.layouts): that graph is dropped and the next backward captures again in
those layouts (a few times per graph at most: a hook whose layout changes every
step keeps its graph, and stops it where it changes). Only where a call cannot
stop its graph, or its layout is no dense one (an expanded grad), is the output
copied into the traced layout (`stats().layout_copies`): that backward may differ
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
from typing import Optional

import torch

from ..errors import ResumeHere
from ..nodes import SLOT_KINDS
from ..nodes.accumulate import HANDED_OVER
from ..nodes.saved_tensors import NotAsLearned
from ..values import REFERENCE, Slot, SlotKind, is_plain, observed_layout
from .checks import _check_ctx, _check_versions, _hooks_added_error, _shared_modified_error, _still_empty_error
from .protocol import DEFINEDNESS, DTYPES, DEVICE_TYPES, KEEPS_INPUTS, PASSES_SHIFT, ReplayFrame, decode_meta


class _Replay(threading.local):
    def __init__(self):
        self.stack: list = []  # (capture, slots, autograd keys excluded, hooks, steal, keep) of the backwards running on this thread
        self.tasks: list = []  # the graph task id each of them runs its calls in
        self.last: list = []  # the slot of the last call each of them ran (None: none yet)


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

    def __init__(self, capture, slots, hooks=(), steal=None, keep=False, versions=None, ctx=None, releases=None, observed=None, refs=None):
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
        # refs: (slot, output) -> what a call handed on by reference (NOTE [Values passed by
        # reference], nodes/references.py)
        self.refs = {} if refs is None else refs
        self.frame = ReplayFrame(
            capture, slots, torch._C._dispatch_tls_local_exclude_set(), hooks, steal, keep, versions, ctx, releases, observed, self.refs
        )

        self.failed_at = None  # the slot of the last call started, when the graph raised

    def __enter__(self):
        _replay.last.append(None)
        try:
            native_calls().push_replay(self.frame, _replay.last)
        except BaseException:  # nothing pushed: leave both stacks as they were
            _replay.last.pop()
            raise
        _replay.stack.append(self.frame)
        _replay.tasks.append(self.task)
        return self

    def __exit__(self, exc_type, *exc):
        native_calls().pop_replay()
        _replay.stack.pop()
        _replay.tasks.pop()
        last = _replay.last.pop()
        if exc_type is not None:
            self.failed_at = last


# NOTE [Engine queries from hooks]
# Hooks run inside a one-node eager graph task (graph_task.py in_graph_task), so what
# the engine answers about "the current backward" is about that task, not ours.
# torch.autograd.graph.register_multi_grad_hook(mode="all") counts the calls it
# waits for with torch._C._will_engine_execute_node: every node but that one
# node read as "will not run", so it waited for none and never called its
# function. While a graph of ours runs, that query (from its own graph task: not
# a nested eager backward's) is answered from the captured graph instead.
def will_engine_execute_node(node):
    """The captured graph's answer, from its own graph task; None: eager's answer (the
    patch of torch._C._will_engine_execute_node is compile/torch_patches.py's)."""
    if _replay.stack and _replay.tasks[-1] != -1 and _replay.tasks[-1] == torch._C._current_graph_task_id():
        return _replay.stack[-1].walk.will_execute(node)
    return None


def call(slot: int, args: list[Optional[torch.Tensor]], meta: list[int], flags: int) -> list[torch.Tensor]:
    """One call of a running graph, in the backward call's dispatch state: the op's kernel (the
    dispatcher runs it below autograd; `at_autograd` and `direct` reach it without that)."""
    frame = _replay.stack[-1]
    capture, slots, outside, hooks, steal, keep = frame.walk, frame.slots, frame.outside, frame.hooks, frame.steal, frame.keep
    versions, ctx, releases, observed = frame.versions, frame.ctx, frame.releases, frame.observed
    s = slots[slot]
    kind, node, mask, in_flags, shared = s.kind, s.node, s.mask, s.in_flags, s.shared
    row = SLOT_KINDS[kind]
    args, passed, values, watched = _split_args(s, args, flags)
    last = _replay.last[-1]
    _replay.last[-1] = slot
    if last is None or slots[last].at != slots[slot].at:
        # the engine runs each node in the backward's own thread-local state: a hook that
        # left grad mode changed (`torch.set_grad_enabled(True)` as a statement) changed it
        # for the rest of its node only (an unpack hook there sees it)
        if torch.is_grad_enabled() != capture.grad_mode:
            torch._C._set_grad_enabled(capture.grad_mode)
    before = [args[i]._version if args[i] is not None else 0 for i in shared]
    by_ref_out = handed = ()
    if s.by_reference:  # NOTE [Values passed by reference] (nodes/references.py)
        by_ref_out, handed = s.by_reference.outs, s.by_reference.handed
        args = list(args)
        for i, src in s.by_reference.args:
            args[i] = frame.refs[src]
        for src in handed:
            del frame.refs[src]
    flat = args
    if s.rebuild:  # tensor subclass arguments, passed as their inner tensors (Slot.rebuild)
        args = _rebuild(args, s.rebuild, in_flags)
    if in_flags:
        # the last argument says which arguments are defined: an undefined grad
        # reached the graph as zeros (NOTE [Undefined grads of opaque nodes]),
        # the hook or node gets None, as in eager
        *args, defined = args
        args = [a if d else None for a, d in zip(args, defined.tolist())]
    inside = torch._C._dispatch_tls_local_exclude_set()
    undo = _set_exclude_set(outside, inside) if inside != outside else ()
    try:
        if row.accumulates:
            give = (HANDED_OVER if handed else None) if s.by_reference else steal if s.fresh else None
            outs = row.run(capture, node, args, mask, None, hooks, give)
        else:
            keeps = keep and flags & KEEPS_INPUTS
            # a grad a hook keeps (`seen.append(g)`) must not become `.grad` as it is: eager's
            # AccumulateGrad sees the hook's reference and copies (NOTE [Stealing a fresh grad])
            # (plain tensors only: a subclass or a value held by reference is never a graph buffer to steal)
            counts = [(a, sys.getrefcount(a)) for a in args if is_plain(a)] if steal is not None and not row.ordering_args else ()
            refs = (frame.refs, by_ref_out) if by_ref_out else None
            watch = shared if keeps else None
            outs = _run_and_conform(capture, slot, row, node, mask, args, meta, flags, hooks, watch, observed, values, s.out_specs, refs)
            for a, n in counts:
                if sys.getrefcount(a) - sum(o is a for o in outs) > n:
                    steal.add(a)
        check_hooks_added(capture, kind, node)
        if watched:
            _check_versions(watched, versions[slot])
        if ctx and slot in ctx:
            _check_ctx(ctx[slot])
        for i, v in zip(shared, before):
            if flat[i] is not None and flat[i]._version != v:
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


def _split_args(s, args, flags) -> tuple:
    """A call's own arguments, apart from what rides along behind them: graph inputs passed
    through the call (read after it), what the graph holds should the call stop it, saved
    tensors checked after it, and values there only to order it."""
    passed = ()
    if flags >> PASSES_SHIFT:  # graph inputs read after this call: returned, so read after it
        n = flags >> PASSES_SHIFT
        passed, args = args[-n:], args[:-n]
    values = None
    if s.n_resume >= 0:  # what the graph holds here, should the call stop it (NOTE [A call output not as traced])
        values, args = args[len(args) - s.n_resume :], args[: len(args) - s.n_resume]
    watched = ()
    if s.n_watch:  # saved tensors read after this call, checked after it
        watched, args = args[-s.n_watch :], args[: -s.n_watch]
    if s.n_after:  # only there to order the call (NOTE [Hooks may change what the graph reads])
        args = args[: -s.n_after]
    return args, passed, values, watched


def _rebuild(flat, rebuild, in_flags) -> list:
    """A call's arguments with each subclass rebuilt from its inner tensors (Slot.rebuild);
    with `in_flags`, the definedness flags stay last."""
    flags = [flat[-1]] if in_flags else []
    flat = flat[:-1] if in_flags else flat
    out, k = [], 0
    for i, spec in rebuild:
        while len(out) < i:
            out.append(flat[k])
            k += 1
        out.append(spec.rebuild(flat[k : k + len(spec.names)]))
        k += len(spec.names)
    return out + list(flat[k:]) + flags


def _flatten_outputs(row, capture, node, outs, out_specs) -> list:
    """A call's outputs with each subclass (Slot.out_specs) in its inner tensors; one of another
    type or metadata than traced (a hook that returned other placements) raises: the graph was
    traced for those."""
    specs = dict(out_specs)
    wide = []
    for i, o in enumerate(outs):
        spec = specs.get(i)
        if spec is None:
            wide.append(o)
        elif o is None:
            wide += [None] * len(spec.names)
        else:
            names, meta = o.__tensor_flatten__() if type(o) is spec.type else ((), None)
            if type(o) is not spec.type or meta != spec.meta or tuple(o.shape) != spec.size:
                what = row.what or f"{row.name.replace('_', ' ')} of {capture.node_name(node)}"
                raise RuntimeError(
                    f"compiled_autograd: {what} returned a {type(o).__name__} ({meta}) where the graph was "
                    f"traced with a {spec.type.__name__} ({spec.meta})"
                )
            wide += [getattr(o, n) for n in spec.names]
    return wide


def check_hooks_added(capture, kind, node) -> None:
    """Raise where what a call ran gave hooks to a node the graph has no call for."""
    stage = SLOT_KINDS[kind].stage
    if stage >= 0 and capture.hooks_added(node, stage):
        _hooks_added_error(kind, capture, node)


def _run_and_conform(
    capture, slot, row, node, mask, args, meta, flags, hooks, shared=None, observed=None, values=None, out_specs=(), by_ref=None
):
    metas = decode_meta(meta)
    try:
        outs = row.run(capture, node, args, mask, metas, hooks, None)
    except NotAsLearned as e:  # an unpack hook's: stop here where the call can (NOTE [A call output not as traced])
        if values is None:
            raise e.__cause__ from None
        raise ResumeHere(slot, [e.value], list(args), list(values), "type") from None
    if by_ref is not None:  # NOTE [Values passed by reference] (nodes/references.py): held, a token in the graph
        refs, positions = by_ref
        outs = list(outs) + [None] * (len(mask) - len(outs))
        for i in positions:  # (the token as traced, whatever the value's dtype: it goes on as eager passes it)
            o, refs[(slot, i)] = outs[i], outs[i]
            outs[i] = None if o is None else metas[sum(mask[:i])].empty()
    if out_specs:
        outs = _flatten_outputs(row, capture, node, outs, out_specs)
    keep = () if shared is None else [a for i, a in enumerate(args) if a is not None and i not in shared]
    return _conform(row.name, capture, node, mask, outs, keep, metas, flags, slot, observed, (args, values))


def _stop_if_not_as_traced(slot, mask, outs, metas, observed, stop) -> None:
    """An output of another type or layout than traced stops the run before anything of it
    enters the graph, where the call can stop it (`stop`: its arguments and the values the graph
    holds there; NOTE [A call output not as traced], capture/resume.py); what the call returned
    goes with it, as it came. What was seen is noted in `observed`."""
    args, values = stop
    why = None
    for k, (i, m) in enumerate(zip([i for i, d in enumerate(mask) if d], metas)):
        o = outs[i] if i < len(outs) else None
        if o is None:
            continue
        if not is_plain(o):
            why = "type"
            if observed is not None:
                observed[(slot, k)] = REFERENCE
        elif (
            list(o.shape) == list(m.shape)
            and o.dtype == m.dtype
            and o.device == m.device
            and not m.has_layout(o.resolve_conj().resolve_neg())
            and observed_layout(o) is not None
        ):
            # (a layout the next trace can take; one it cannot -- an expanded grad, a hook's
            # `g` with stride 0 -- is copied, here as on every backward; _conform raises for the rest)
            why = why or "layout"
            if observed is not None:
                observed[(slot, k)] = observed_layout(o)
    if why is not None:
        outs = list(outs) + [None] * (len(mask) - len(outs))
        raise ResumeHere(slot, [o if m else None for o, m in zip(outs, mask)], list(args), list(values), why)


def input_storages(args):
    """The storages of a graph's tensor inputs, by identity (NOTE [Stealing a fresh grad]):
    the native helper's StorageSet, whose weak references pin their StorageImpls for the
    graph's run (a boxed graph frees inputs as it goes; a new grad may get a freed input's
    memory, never its StorageImpl). `t in storages`; `storages.add(t)`: never steal t's
    memory (a hook kept a reference to it)."""
    from .. import native

    return native.load().StorageSet([t for t in args if isinstance(t, torch.Tensor)])


_op = None  # torch.ops.compiled_autograd.call.default, once installed (calls/__init__.py install)


def _fast_path() -> bool:
    """Whether a call can skip the dispatcher's way to the kernel: grad mode off and no
    dispatch mode (a trace) active, as when a compiled graph runs; or grad mode on where the
    running graph is a create_graph one (NOTE [create_graph with an opaque node], replay/run.py):
    what the call returns then keeps the history its node built."""
    return torch._C._len_torch_dispatch_stack() == 0 and (
        not torch.is_grad_enabled() or bool(_replay.stack and _replay.stack[-1].walk.grad_mode)
    )


def at_autograd(slot, args, meta, flags):
    """The kernel at the Autograd key. A compiled graph calls the op with grad mode off and no
    dispatch mode active: the kernel runs there and then, skipping custom_op's Python
    autograd wrapper and its redispatch below autograd (about 20 us of a call's ~120). The
    call has no derivative (graphs under create_graph have no calls: runtime.py), so
    otherwise, and while a trace (make_fx's proxy mode, fake tensors, functionalization)
    is active, it goes on below autograd as any op does."""
    if _fast_path():
        return call(slot, args, meta, flags)
    with torch._C._AutoDispatchBelowAutograd():
        return _op(slot, args, meta, flags)


def _direct(slot, args, meta, flags):
    """The call without the dispatcher (its boxing of the arguments costs ~10 us), for the
    graphs that run as Python code we generate (the eager backend, aot_eager's graph:
    compile/boxed.py): the same kernel, where the dispatcher would run it directly."""
    if _fast_path():
        return call(slot, args, meta, flags)
    return _op(slot, args, meta, flags)


# The name inductor's generated Python code calls a call by (compile/inductor.py
# _register_inductor_lowering): the direct call, reachable from the `torch` every such module
# imports (install sets it)
DIRECT_KERNEL_NAME = "torch.ops.compiled_autograd.call.default._compiled_autograd_direct"

# NOTE [Calls in the helper]
# One act, `call`, reached three ways: through the dispatcher (the op's kernel, below
# autograd), at its Autograd key (`at_autograd`: a compiled graph calls it with grad mode off
# and no dispatch mode, so the kernel runs there and then), and `direct`, without the
# dispatcher, from the code we generate (compile/boxed.py, compile/inductor.py). A call out of
# compiled code costs its Python: the frames, slicing the arguments, the grad-mode and
# dispatch-key checks, the checks after it; that was most of a hook's cost against eager (a
# clamping hook on a parameter: ~12 us a call against eager's ~5 us). So `direct` is the native
# helper's where it is loaded: it takes AccumulateGrad, hook and opaque-node calls through
# `call`'s steps in C++, reading each kind's row of the one slot-kind table (nodes/__init__.py
# SLOT_KINDS, given to it by name: install_native) and the Slot and frame fields by name, and
# raises through the same functions here (_hooks_added_error, _check_versions, _check_ctx,
# _shared_modified_error); an output not exactly as traced goes to `_conform`, the one place of
# those rules (NOTE [A call output not as traced], capture/resume.py). An unpack call, a call
# off the fast path (grad mode on, a dispatch mode active), or one whose thread excludes other
# dispatch keys than the backward call did, goes to `_direct` or `call` here.
direct = _direct  # what compiled code calls: the helper's, once loaded (native_calls)
_native_module = None


def native_calls():
    """The native helper, with its direct call installed (NOTE [Calls in the helper])."""
    global _native_module, direct
    if _native_module is None:
        from .. import native

        mod = native.load()
        install_native(mod)
        direct = _op._compiled_autograd_direct = mod.direct
        _native_module = mod
    return _native_module


def install_native(mod, python_call=None) -> None:
    """Give the helper's direct call the slot-kind table and the Python it hands other calls
    to (`python_call`: `call`, or a test's wrapper of it)."""
    mod.install_calls(_native_table(python_call))


def _native_table(python_call) -> dict:
    """What the helper is given: the Python it hands calls to, the rows of the kinds it runs, and
    the fields of the tuples it reads, by name (NOTE [Calls in the helper])."""
    return {
        "direct": _direct,
        "call": python_call or call,
        "kinds": [row._replace(native=int(row.native)) for row in SLOT_KINDS.values() if row.native >= 0],
        "kind_fields": SlotKind._fields,
        "slot_fields": Slot._fields,
        "frame_fields": ReplayFrame._fields,
        "dtypes": DTYPES,
        "device_types": DEVICE_TYPES,
        "parameter_class": torch.nn.Parameter,
        "conform": conform_from_native,
        "check_versions": _check_versions,
        "check_ctx": _check_ctx,
        "hooks_added_error": _hooks_added_error,
        "shared_modified_error": _shared_modified_error,
        "still_empty_error": _still_empty_error,
    }


def call_fake(slot, args, meta, flags):
    """The op's outputs on fakes: as its `meta` says, then its flags' and passed inputs'."""
    outs = [m.empty() for m in decode_meta(meta)]
    if flags & DEFINEDNESS:
        outs.append(torch.empty(len(outs), dtype=torch.bool))
    if flags >> PASSES_SHIFT:  # returned as they are: same geometry
        outs += [torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device) for a in args[-(flags >> PASSES_SHIFT) :]]
    return outs


def _conform(kind, capture, node, mask, outs, keep, metas, flags, slot=None, observed=None, stop=None):
    """Real outputs -> the defined, non-aliasing tensors, in the traced layouts, the graph expects.

    `mask[i]` says whether output i was defined when the graph was traced;
    `metas` describes those outputs, in order. With flags (opaque nodes and
    hooks) a missing grad becomes zeros and a False flag, so the graph knows
    it is undefined. A grad where none was expected: from an opaque node it
    goes nowhere (its edge is not in the graph); a hook that makes a None grad
    defined cannot be followed (the graph has no place for it) and raises.
    An output of another type or layout than traced stops the run where the call can
    (`stop`: its arguments and the values the graph holds there; NOTE [A call output not as
    traced], capture/resume.py); elsewhere, one in another layout is copied into the traced
    one, `observed` recording the layout it had (NOTE [Layouts of call outputs]), and one of
    another type raises: it never enters the graph."""
    # `outs` (the list the hook or node returned) is taken over: its entries are
    # cleared as they are read, so that a private tensor has no reference left but ours
    outs.extend([None] * (len(mask) - len(outs)))
    row = SLOT_KINDS[kind]
    if not row.new_grads_go_nowhere and any(o is not None and not m for o, m in zip(outs, mask)):
        raise RuntimeError(
            f"compiled_autograd: {kind.replace('_', ' ')} of {capture.node_name(node)} returned a gradient "
            "where the backward had None; the compiled graph cannot follow"
        )
    if stop is not None and stop[1] is not None:
        _stop_if_not_as_traced(slot, mask, outs, metas, observed, stop)
    result, present = [], []
    positions = [i for i, m in enumerate(mask) if m]
    for k, (i, m) in enumerate(zip(positions, metas)):
        o, outs[i] = outs[i], None
        if o is None:
            present.append(False)
            result.append(m.empty().zero_())
            continue
        present.append(True)
        if not is_plain(o) or list(o.shape) != list(m.shape) or o.dtype != m.dtype or o.device != m.device:
            what = row.what or f"{kind.replace('_', ' ')} of {capture.node_name(node)}"
            got = f"a {type(o).__name__}" if not is_plain(o) else f"a tensor of {tuple(o.shape)}/{o.dtype}/{o.device}"
            if observed is not None and not is_plain(o):
                observed[(slot, k)] = REFERENCE  # (the next capture holds it by reference)
            raise RuntimeError(
                f"compiled_autograd: {what} returned {got} where the graph was traced with a tensor of "
                f"{tuple(m.shape)}/{m.dtype}/{m.device}"
                + ("" if is_plain(o) else "; this graph cannot stop there and go on in eager's order (NOTE [A call output not as traced])")
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


def conform_from_native(slot, outs, keep, meta, flags, args, values):
    """_conform for a call the native helper ran whose outputs are not all plain, as traced:
    the same rules, in one place (NOTE [Calls in the helper])."""
    frame = _replay.stack[-1]
    s = frame.slots[slot]
    return _conform(
        s.kind,
        frame.walk,
        s.node,
        s.mask,
        outs,
        keep,
        decode_meta(meta),
        flags,
        slot,
        frame.observed,
        (args, values) if s.n_resume >= 0 else None,
    )


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
