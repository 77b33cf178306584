"""Capture: trace one whole backward into a torch.fx graph.

The loop below is the eager engine's, run on fake tensors under make_fx: nodes
in engine order (the native collector computed it), gradients summed per input
in arrival order, then per node: tensor pre-hooks and retain_grad, pre-hooks,
the node, validate_outputs, post-hooks. What each step becomes in the graph:

  built-in node          its real C++ formula (apply_with_saved), as aten ops
  custom Function        its Python backward, traced, with ctx.saved_tensors
                         and tensor ctx attributes swapped for the fakes
  opaque node / hooks    one compiled_autograd::call (see NOTE [Opaque calls])
  AccumulateGrad         a graph result, applied after the graph; or, when
                         hooks or opaque nodes could observe `.grad`, an
                         opaque call at its eager position

NOTE [Undefined grads of opaque nodes]
An opaque node's output that its edge expects is predicted defined, and so is
what a hook returns for a defined grad. If at replay it is undefined (the node
returned None, or a hook did: a module's full backward hook may return None to
block a gradient), the call returns zeros and a False flag; values carry the
flags they depend on ("defined iff any of these flags") through nodes and
sums, and a graph result carrying flags gets a definedness output, so a leaf
whose only gradient was undefined still ends with `.grad is None` as in eager.
A call given such a value (a hook, an opaque node, AccumulateGrad) also gets
its definedness and passes None where it is undefined, as eager would. A
traced formula given it as its only grad computes on the zeros: its results
carry the same flags, and where they are summed with another grad they are
masked first (`sum_grads`: a formula can turn zeros into NaN, 0 / 0 in sqrt's at 0;
a value no formula ran on since its call, zeros when undefined, needs no mask).
A built-in node given it beside other grads runs opaquely instead: its formula
skips an undefined grad's terms, where zeros could make NaN (0 * inf).

NOTE [Values passed by reference]: nodes/references.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .. import config
from ..errors import Fallback, NeedsOpaque, NotTwiceDifferentiable
from ..nodes import FAMILIES, accumulate, builtin, hooks, opaque, references, saved_tensors
from ..calls import protocol
from ..values import ByReference, Collected, OutputMeta, Plan, Slot, SubclassSpec
from ..observe.stats import LOCK, STATS
from .fakes import fake_inputs
from .record import Recorder, record
from ..nodes.grads import Value, defined, sum_grads, union_bits
from .create_graph import late_leaf_hooks, once_differentiable
from . import resume, subclass_calls
from .lint import lint
from .passes import mark_fresh_grads, mark_shared_args, passable_inputs, releases, reorder_for_calls, version_checked_inputs

log = logging.getLogger("compiled_autograd")

MAX_OPAQUE_RETRIES = 16  # traces of one backward, each making one more node opaque


class _BackwardTracer:
    def __init__(self, collected: Collected, opaque_extra: dict[int, str], size_inputs=(), layouts=None, create_graph=False, late=False):
        self.c = collected
        self.layouts = layouts or {}  # (slot, output) -> dim order seen at run time (_layout)
        self.size_inputs = tuple(size_inputs)
        self.sym_sizes = [None] * collected.n_size_inputs
        self.walk = collected.walk
        self.nodes = collected.nodes
        self.opaque_extra = opaque_extra
        self.slots: list = []
        self.at = -1  # the node being traced (Slot.at)
        self.ctx_checks: dict = {}  # slot -> custom Function nodes whose ctx is checked after it
        self.results: list = []
        self.accumulate: list = []
        # create_graph=True, or a user's backend, whose code may write into a grad it handed over
        # (`late`): a leaf's own hooks run as its grad is applied, after the graph, where
        # AccumulateGrad may steal it (NOTE [A leaf's hooks under create_graph], capture/create_graph.py)
        self.leaf_hooks: list = []
        self.late = late_leaf_hooks(self.nodes, create_graph, late)
        # NOTE [A call output not as traced] (capture/resume.py)
        self.result_calls: list = []  # (result index, flag index) per _result, in order
        self.resume_points: list = []  # what the trace held at each call the first run may stop at
        self.resumable = not create_graph and resume.resumable(collected)
        self.buffers: dict = {}
        self.resumed_inputs: list = []  # a resumed step's node inputs (_step)
        self.again = None  # a custom Function made opaque that AccumulateGrad's place depends on (_apply)
        self.wrapped: list = []  # Plan.wrapped: results that are tensor subclasses, flattened
        # NOTE [Values passed by reference]: id(token) -> (source, token) per token in the graph
        self.refs: dict = {}
        self.by_reference: list = []  # Plan.by_reference: (result index, source) per result that is a token
        self.in_graph_accumulate = collected.grad_on_ctx or any(
            (opaque.is_opaque(self, i) and opaque.may_read_grads(self, i)) or (n.hooks.any and not self.late)
            for i, n in enumerate(self.nodes)
        )

    # -- graph results -------------------------------------------------------
    def _result(self, v: Value | None) -> tuple[int, int]:
        rf = self._new_result(v)
        self.result_calls.append(rf)
        return rf

    def _new_result(self, v: Value | None) -> tuple[int, int]:
        if v is None:
            return -1, -1
        r = len(self.results)
        if id(v.t) in self.refs:  # a value held beside the graph: it replaces the token (replay/run.py)
            self.by_reference.append((r, self.refs[id(v.t)][0]))
        if is_traceable_wrapper_subclass(v.t):
            # a subclass result: its inner tensors are graph results from r on, and replay/run.py
            # rebuilds it with the metadata the trace's dispatch gave it (docs/design/subclasses.md
            # section 4)
            spec, inner = self._flatten(v.t)
            self.wrapped.append((r, spec))
            self.results.extend(inner)
            self.unconsumed.extend(inner)
        else:
            self.results.append(v.t)
            self.unconsumed.append(v.t)
        if v.bits is None:
            return r, -1
        self.results.append(self._defined(v.bits))
        return r, len(self.results) - 1

    _defined = staticmethod(defined)

    @staticmethod
    def _flatten(t) -> tuple[SubclassSpec, list]:
        spec, inner = SubclassSpec.of(t)
        if any(is_traceable_wrapper_subclass(x) for x in inner):
            raise Fallback(f"tensor subclass {type(t).__name__} with a subclass inside (not yet: docs/design/subclasses.md)")
        return spec, inner

    def _defined_each(self, values):
        """Per value (None counts as defined: the call gets None anyway), whether it is defined."""
        true = None
        out = []
        for v in values:
            if v is None or v.bits is None:
                if true is None:
                    true = torch.ones((), dtype=torch.bool)
                out.append(true)
            else:
                out.append(self._defined(v.bits))
        return torch.stack(out)

    # -- values passed by reference -------------------------------------------
    def is_reference(self, t) -> bool:
        """Whether t is the token of a value a call handed on by reference."""
        return t is not None and id(t) in self.refs

    # -- opaque calls --------------------------------------------------------
    def _call(
        self, kind, node, args, out_metas, flags=False, values=None, keeps=None, outs_like_args=False, by_reference_outs=(), out_specs=()
    ):
        """One compiled_autograd::call; returns the outputs positionally (None where not predicted).

        `values`: the _Values the tensors in `args` come from. Where one may be
        undefined (it carries flags), the call also gets each argument's
        definedness, and passes None for an undefined one, as eager would.
        `by_reference_outs`: the outputs it hands on by reference (NOTE [Values passed by
        reference]); an argument that is a token gets its value back before the call.
        `out_specs`: the subclasses it returns as their inner tensors (`out_metas` theirs), where no
        argument says (NOTE [Unpacked tensor subclasses], nodes/saved_tensors.py)."""
        args, out_metas, rebuild, flat_specs, held = subclass_calls.flatten_args(self, kind, args, out_metas, flags, outs_like_args)
        out_specs = out_specs or flat_specs
        by_reference_outs = tuple(by_reference_outs) + held + references.learned(self, len(self.slots), out_metas)
        mask = tuple(m is not None for m in out_metas)
        slot = len(self.slots)
        refs_in = tuple((k, self.refs[id(a)][0]) for k, a in enumerate(args) if self.is_reference(a))
        by_reference = ByReference(refs_in, tuple(by_reference_outs)) if refs_in or by_reference_outs else None
        in_flags = values is not None and any(v is not None and v.bits is not None for v in values)
        if in_flags:
            args = list(args) + [self._defined_each(values)]
        self.slots.append(Slot(kind, node, mask, in_flags, at=self.at, rebuild=rebuild, out_specs=out_specs, by_reference=by_reference))
        # (a first run cannot stop and go on in eager's order once values are held by reference)
        if self.resumable and kind in resume.KINDS and any(mask) and not rebuild and not out_specs and not self.refs and not by_reference:
            point = resume.held(self, slot, kind)
            if point is not None:
                self.resume_points.append(point)
        metas = [self._layout(slot, k, m) for k, m in enumerate(m for m in out_metas if m is not None)]
        keeps = flags if keeps is None else keeps
        bits = (
            (protocol.DEFINEDNESS if flags else 0) | (protocol.KEEPS_INPUTS if keeps else 0) | protocol.FREED_NOT_REUSED | protocol.DIRECT
        )
        outs = torch.ops.compiled_autograd.call(slot, list(args), protocol.encode_meta(metas), bits)
        flag = outs[-1] if flags else None
        it = iter(outs)
        positional = [next(it) if m else None for m in mask]
        for i in by_reference_outs:
            if positional[i] is not None:
                self.refs[id(positional[i])] = ((slot, i), positional[i])
        return subclass_calls.regroup(positional, mask, out_specs), flag

    def _layout(self, slot, k, meta) -> OutputMeta:
        """Output k of call `slot` as the trace predicts it (NOTE [Layouts of call outputs],
        calls/kernel.py): in the layout it had at run time when that differed from the prediction
        before (`layouts`), else as given: an OutputMeta, or (shape, dtype, device), contiguous."""
        if not isinstance(meta, OutputMeta):
            shape, dtype, device = meta
            meta = OutputMeta.dense(shape, dtype, torch.device(device))
        return self._seen_layout(meta, self.layouts.get((slot, k)))

    @staticmethod
    def _seen_layout(meta: OutputMeta, seen) -> OutputMeta:
        """`meta` laid out as a backward showed (values.observed_layout), if it showed one."""
        if seen == "sparse_coo":
            return OutputMeta(meta.shape, meta.dtype, meta.device, [0] * len(meta.shape), torch.sparse_coo)
        if isinstance(seen, tuple) and len(seen) == len(meta.shape):
            return OutputMeta.dense(meta.shape, meta.dtype, meta.device, seen)
        return meta

    # -- the loop -------------------------------------------------------------
    def run(self, args, body=None):
        """The trace of the whole backward on `args` (or `body()`, with the same set-up: a
        resumed run, capture/resume.py)."""
        c, capture = self.c, self.walk
        n = len(c.lifted)
        sym = [None] * c.n_size_inputs
        dims = list(c.sizes[c.in_graph_start :])  # shapes of the tensors unpacked in the graph
        aot_ints = list(c.sizes[c.aot_start : c.in_graph_start])  # NOTE [Inlining AOTAutograd backwards]
        for j, s in zip(self.size_inputs, args[n:]):
            if j < c.n_size_inputs:
                sym[j] = s
            elif j >= c.in_graph_start:
                dims[j - c.in_graph_start] = s
            else:
                aot_ints[j - c.aot_start] = s
        self.sym_sizes = sym
        self.aot_ints = aot_ints
        self.in_graph_metas = saved_tensors.in_graph_metas(c.in_graph, c.hooks, dims)
        self.node_inputs: list = []  # the grads entering the node being traced (their Values: node_values)
        self.node_values, self.unpacked_here = [], {}  # (and what it unpacked so far: resume.held)
        self.unconsumed: list = []  # graph results (grads for AccumulateGrad or grad()) since the last unpack call
        if c.wrappers:  # each lifted subclass rebuilt over its inner tensors' fakes (docs/design/subclasses.md section 2)
            args = list(args)
            for w in c.wrappers:
                args[w.index] = w.rebuild(args)
        unpacked = [args[i] if i >= 0 else None for i in c.unpacked]
        capture.begin_trace(list(args[: c.n_native]), unpacked, functools.partial(saved_tensors.unpack_in_graph, self), sym)
        try:
            return self._run(args) if body is None else body()
        finally:
            capture.end_trace()

    def _run(self, args):
        capture = self.walk
        self.buffers = {}  # node -> the grads waiting for it, per input (the engine's InputBuffers)
        roots = capture.roots()
        for (idx, nr, _), t in zip(roots, references.root_values(self, args, roots)):
            self._add(idx, nr, None if t is None else Value(t))
        captured = [(-1, -1)] * capture.num_results()
        for idx, node in enumerate(self.nodes):
            self._step(idx, self.buffers.pop(idx, [None] * node.num_inputs), args, captured)
        if self.again is not None:
            raise NeedsOpaque(self.again, self.opaque_extra[self.again])
        return self.results, captured

    def _add(self, idx, nr, v: Value | None):
        if idx < 0 or v is None:
            return
        buf = self.buffers.setdefault(idx, [None] * self.nodes[idx].num_inputs)
        if buf[nr] is not None and (self.is_reference(buf[nr].t) or self.is_reference(v.t)):
            buf[nr] = references.sum_grads(self, buf[nr], v)
        else:
            buf[nr] = sum_grads(buf[nr], v)

    def _step(self, idx, values, args, captured, done=None):
        """Node idx's step of the engine on the grads that reached it. `done`: the kind of the
        call of this step that already ran, `values` then being what it returned (a step
        resumed after it: NOTE [A call output not as traced],
        capture/resume.py)."""
        node = self.nodes[idx]
        self.at = idx
        on, kind = node.hooks, node.kind  # (the node's hook counts)
        leaf = FAMILIES[kind].leaf  # AccumulateGrad: the tensor hooks on it are its leaf's
        # grad() captures what reaches a node: after its tensor pre-hooks when the node
        # does not run, before them when it does (the engine's evaluate_function)
        if done is None and not node.execute and (on.tensor_pre or on.retains):
            values = hooks.call(self, hooks.TENSOR_PRE_HOOKS, idx, values)
        if done is None or (done == hooks.TENSOR_PRE_HOOKS and not node.execute):
            for nr, out_idx in node.captures:
                captured[out_idx] = self._result(values[nr])
        if not node.execute:
            return
        # a leaf's tensor hooks and its accumulation: one call (NOTE [A leaf's hooks and
        # its accumulation in one call], nodes/accumulate.py), where its grad is always defined
        hooked = None
        if done is None:
            # (not with post hooks on the node: they get the grads the tensor hooks returned)
            if leaf and self.in_graph_accumulate and (on.tensor_pre or on.retains) and not on.pre and not on.post:
                v = values[0]
                hooked = v if v is not None and v.bits is None else None
            if leaf and self.late and not self.in_graph_accumulate and on.tensor_pre:
                self.leaf_hooks.append(idx)  # (called as its grad is applied)
            elif (on.tensor_pre or on.retains) and hooked is None:
                values = hooks.call(self, hooks.TENSOR_PRE_HOOKS, idx, values)
        if done in (None, hooks.TENSOR_PRE_HOOKS) and on.pre:
            values = hooks.call(self, hooks.PRE_HOOKS, idx, values)
        if done in (opaque.NODE, hooks.POST_HOOKS):
            outputs = [None if o is None else Value(o) for o in values]
            values = self.resumed_inputs  # (a resumed step: the node's inputs, for its post hooks)
        elif leaf and hooked is not None:
            self._call(accumulate.HOOKED_ACCUMULATE, idx, [hooked.t], [])
            outputs = []
        elif leaf:
            accumulate.trace(self, idx, values[0])
            outputs = []
        else:
            in_bits = self._input_bits(values)
            outputs = self._apply(idx, kind, values, args)
            outputs = [None if o is None else (o if isinstance(o, Value) else self._output_value(o, in_bits, values)) for o in outputs]
        if on.post and done != hooks.POST_HOOKS:
            outputs = hooks.post_hooks(self, idx, outputs, values)
        for (to, nr), v in zip(node.edges, outputs):
            self._add(to, nr, v)

    @staticmethod
    def _input_bits(values):
        defined = [v for v in values if v is not None]
        if not defined or any(v.bits is None for v in defined):
            return None
        return union_bits(*(v.bits for v in defined))

    def _apply(self, idx, kind, values, args):
        """The node's step, by its family's rule (nodes/__init__.py FAMILIES): its outputs."""
        if opaque.is_opaque(self, idx):
            return opaque.trace(self, idx, values)
        if any(v is not None and self.is_reference(v.t) for v in values):
            # opaque from here on; a custom Function's opaque backward may read `.grad`, which
            # decides where AccumulateGrad runs (in_graph_accumulate): traced again for it, once
            # for all of them (_run; opaque_extra is the capture's own, kept across its traces)
            self.opaque_extra[idx] = "given a grad passed by reference (a tensor subclass the graph cannot hold)"
            if idx in self.c.pynodes and not self.in_graph_accumulate:
                self.again = idx
            return opaque.trace(self, idx, values)
        return FAMILIES[kind].trace(self, idx, values, args)

    @staticmethod
    def _output_value(o, in_bits, values) -> Value:
        """A node's output: exact (zeros whenever undefined) when it is an exact input the
        node hands through as it is (BackwardHookFunction's backward, AddBackward's), not
        changed in place since (a backward may return `g.div_(x)`: its version moved)."""
        exact = in_bits is not None and any(v is not None and v.exact and o is v.t and o._version == v.version for v in values)
        return Value(o, in_bits, exact=exact)


@dataclass
class Captured:
    graph: torch.fx.GraphModule
    plan: Plan
    example_inputs: list  # fake tensors (and SymInts of dynamic size inputs) the graph was traced with
    mask: tuple | None  # per size position: symbolic? (None: static graph)
    size_inputs: tuple  # size-input positions that are graph inputs
    guard_source: str | None
    shape_env: ShapeEnv | None
    # a live record (NOTE [Recording on the real tensors]): the graph's results as the record
    # computed them (this backward's; the caller takes them), and no fakes
    results: list | None = None
    how: str = ""  # how the graph was traced, and why not the cheaper way (explain())


def capture_backward(*args, **kwargs) -> Captured:
    """NOTE [One capture trace at a time]
    Fake tensors are not thread-safe: their dispatch cache and converter state are process
    globals. Two captures tracing at once in two threads -- each backward of a threaded
    training loop's first step -- made formulas fail on their fakes at random (a node made
    opaque that is not in a run alone: 4 to 88 opaque nodes in one run of the same programs)
    and, in about one run in ten, a graph that returned a wrong gradient with no error
    (tests/test_fuzz.py threads, seed 14). make_fx's traces took the fx trace lock (NOTE [One
    fx trace at a time], compile/torch_patches.py); the recorder, which traces without fx,
    did not. Every capture's trace now holds that lock, live records too: one capture traces
    at a time in the process; a hit never waits for it."""
    from ..compile.torch_patches import trace_lock

    with trace_lock:
        return _capture_backward(*args, **kwargs)


def _capture_backward(
    collected: Collected,
    opaque_names: tuple = (),
    mask=None,
    history=(),
    create_graph=False,
    layouts=None,
    live: bool = False,
    late: bool = False,
) -> Captured:
    """Trace the whole backward (symbolic where `mask` says; `history`: the
    sizes of earlier backwards of this key); nodes that cannot be traced
    become opaque. With `create_graph`, the formulas run in grad mode, as the
    engine runs them then, on fakes that require grad where the real tensors do.
    `live`: the caller will take a live record's results as this backward's (NOTE [Recording
    on the real tensors]); otherwise running the ops for real would only cost time."""
    opaque_extra: dict[int, str] = builtin.other_path(collected, create_graph)  # NOTE [Formulas that take another path when traced]
    opaque_extra.update(
        {i: "marked opaque" for i, n in enumerate(collected.nodes) if n.name in opaque_names and FAMILIES[n.kind].opaque_by_name}
    )
    recording = config.RECORD.on()  # (NOTE [Recording a static trace]; read when used)
    live = (
        live
        and recording
        and config.RECORD_LIVE.on()
        and mask is None
        and not create_graph
        and not opaque_extra
        and _all_built_in(collected)
    )
    refused: list = []  # why a cheaper way was left: the live record's, the fake record's
    for _ in range(MAX_OPAQUE_RETRIES):
        if live:  # NOTE [Recording on the real tensors] (capture/record.py)
            live = False
            captured = _record_live(collected, opaque_extra, layouts, refused)
            if captured is not None:
                return captured
        mode, shape_env, fakes, symints, size_inputs, real_mask = fake_inputs(collected, mask, history)
        tracer = _BackwardTracer(collected, opaque_extra, size_inputs, layouts, create_graph, late)
        out: dict[str, Any] = {}

        def backward_graph(*args):
            results, captured = tracer.run(args)
            out["captured"] = captured
            return results

        grad_mode, collected.walk.grad_mode = collected.walk.grad_mode, create_graph
        try:
            with torch.set_grad_enabled(create_graph), mode, _quiet_fake_tensor_errors():
                if recording and not symints and not create_graph:
                    gm = _record(backward_graph, fakes, refused)
                    if gm is None:  # traced again with make_fx, on new fakes
                        recording = False
                        continue
                else:
                    # (an explicit table, even empty: NOTE [A detach stays a gradient cut])
                    gm = make_fx(backward_graph, tracing_mode="real", _allow_non_fake_inputs=False, decomposition_table={})(
                        *fakes, *symints
                    )
        except NeedsOpaque as e:
            opaque_extra[e.idx] = e.reason
            continue
        finally:
            collected.walk.grad_mode = grad_mode
        differentiable = None
        if create_graph:
            differentiable = tuple(isinstance(r, torch.Tensor) and r.requires_grad for r in tracer.results)
            error = once_differentiable(tracer.results, fakes)
            if error is not None:
                raise NotTwiceDifferentiable(error)
        plan = _plan(gm, tracer, collected, out["captured"], differentiable, len(tracer.results))
        how = "recorded on fakes" if recording and not symints and not create_graph else "traced with make_fx"
        return Captured(gm, plan, fakes + symints, real_mask, size_inputs, None, shape_env, how="; ".join([how, *refused]))
    raise RuntimeError("compiled_autograd: could not trace this backward")


def _plan(gm, tracer, collected, captured, differentiable, num_results) -> Plan:
    """The traced graph cleaned up and ordered for its calls, and its Plan."""
    if gm.graph.eliminate_dead_code():
        gm.recompile()
    opaque_nodes = tuple(
        (i, tracer.nodes[i].name, opaque.reason(tracer, i))
        for i in range(len(tracer.nodes))
        if tracer.nodes[i].execute and opaque.is_opaque(tracer, i)
    )
    slots, watch = reorder_for_calls(
        gm,
        mark_shared_args(gm, mark_fresh_grads(gm, references.handed_over(tracer.slots, tracer.by_reference))),
        version_checked_inputs(collected),
        passable_inputs(collected),
        collected.arriving,
    )
    slots, points = resume.pass_values(gm, slots, resume.points(gm, tracer))  # NOTE [A call output not as traced]
    if config.LINT.on():  # NOTE [The layout of a call's arguments] (capture/lint.py)
        lint(gm, slots)
    return Plan(
        slots=slots,
        watch=watch,
        ctx_checks=tuple((slot, tuple(idxs)) for slot, idxs in tracer.ctx_checks.items()),
        accumulate=tuple(tracer.accumulate),
        captured=tuple(captured),
        opaque=opaque_nodes,
        num_results=num_results,
        differentiable=differentiable,
        releases=releases(tracer.slots, tracer.nodes),
        leaf_hooks=tuple(tracer.leaf_hooks),
        resume=points,
        result_calls=tuple(tracer.result_calls),
        wrapped=tuple(tracer.wrapped),
        stand_ins=tuple(w.index for w in collected.wrappers) + collected.held,
        held=collected.held,
        by_reference=tuple(tracer.by_reference),
    )


def _all_built_in(collected) -> bool:
    """Whether a live record may take this backward: built-in formulas and AccumulateGrad
    only, no hook of any kind, nothing opaque, no tensor whose data a hook brings (NOTE
    [Recording on the real tensors])."""
    if (
        collected.unpacked
        or collected.in_graph
        or collected.pynodes
        or collected.grad_on_ctx
        or collected.n_aot
        or collected.arriving
        or collected.wrappers
    ):
        return False
    return all(FAMILIES[n.kind].live and not n.opaque and not n.hooks.any for n in collected.nodes)


def _record_live(collected, opaque_extra, layouts, refused: list) -> Captured | None:
    """The backward recorded on its real tensors, its results computed; None where the
    recorder refused (nothing of the backward changed: the caller traces on fakes)."""
    tracer = _BackwardTracer(collected, dict(opaque_extra), (), layouts)
    recorder = Recorder(live=True)
    out: dict[str, Any] = {}

    def backward_graph(*args):
        results, out["captured"] = tracer.run(args)
        return results

    grad_mode, collected.walk.grad_mode = collected.walk.grad_mode, False
    try:
        with torch.no_grad():
            gm = record(backward_graph, list(collected.lifted), recorder)
        if tracer.opaque_extra or tracer.slots:  # (not expected: a node made opaque, a call)
            recorder._fail("an opaque node")
    except Exception as e:
        _refused(refused, "the live record", recorder, e, "live_refusals")
        return None
    finally:
        collected.walk.grad_mode = grad_mode
    results = tracer.results
    tracer.results = tracer.unconsumed = tracer.node_inputs = None  # (the caller holds the only references)
    plan = _plan(gm, tracer, collected, out["captured"], None, len(results))
    return Captured(gm, plan, [], None, (), None, None, results=results, how="recorded on the real tensors")


def _record(backward_graph, fakes, refused: list):
    """The static trace recorded, or None where the recorder leaves it to make_fx. A
    NeedsOpaque that the recorder did not cause is the node's own: raised as make_fx's is."""
    recorder = Recorder()
    try:
        return record(backward_graph, fakes, recorder)
    except Exception as e:
        if isinstance(e, NeedsOpaque) and recorder.failed is None:
            raise
        _refused(refused, "the record on fakes", recorder, e, "make_fx_traces")
    return None


def _refused(refused: list, what: str, recorder, e: Exception, counter: str) -> None:
    """A recorder that left the capture to the next way to trace: why (for explain()), counted."""
    why = recorder.failed or f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    log.debug("capture: %s refused: %s", what, why)
    refused.append(f"{what} refused: {why}")
    with LOCK:
        setattr(STATS, counter, getattr(STATS, counter) + 1)


# NOTE [A detach stays a gradient cut]
# A create_graph graph is run again in grad mode and differentiated (NOTE [create_graph] in
# capture/create_graph.py): each `aten.detach` in it must stay a cut, as eager's detach (and
# what a custom backward computes without grad mode: NOTE [Ops without grad mode under
# create_graph] in nodes/function.py) is. From torch 2.14, make_fx called without a
# decomposition table decomposes `detach` into `aten.alias`, which autograd differentiates
# through: the second order went through no_grad constants (a wrong gradient, found by
# tests/test_create_graph.py on 2.14). An explicit table, even an empty one, keeps `detach`
# (make_fx's docstring and code in 2.14 and 2.15: the default detach decomposition is added
# only when the table is None); on 2.13 an empty table is what None meant, so every release
# traces the same graph.


@contextlib.contextmanager
def _quiet_fake_tensor_errors():
    """A formula that fails on fake tensors (a meta kernel that needs concrete sizes under a
    dynamic trace) makes that node opaque (NeedsOpaque); torch's fake-tensor code also logs
    the failure with its traceback at error level, which is not the user's error."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
