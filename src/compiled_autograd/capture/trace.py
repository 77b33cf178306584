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
masked first (`_sum`: a formula can turn zeros into NaN, 0 / 0 in sqrt's at 0;
a value no formula ran on since its call, zeros when undefined, needs no mask).
A built-in node given it beside other grads runs opaquely instead: its formula
skips an undefined grad's terms, where zeros could make NaN (0 * inf).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import sympy
import torch
from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import (
    SYMPY_INTERP,
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)

from ..nodes import compiled_region as aot

from ..replay import calls as ops
from ..values import NodeKind, Plan, Slot
from .tracing import _tracing, is_tracing
from ..walk.collect import PYNODE_KIND, Collected, _tensors, fill_sizes, kept_indices, state_reads, swapped, user_backward

ACCUMULATE_KIND = NodeKind.ACCUMULATE
MAX_OPAQUE_RETRIES = 16  # traces of one backward, each making one more node opaque


class NeedsOpaque(Exception):
    def __init__(self, idx: int, reason: str):
        super().__init__(reason)
        self.idx = idx
        self.reason = reason


class _Value:
    """A gradient flowing in the traced graph and what its definedness depends on."""

    __slots__ = ("t", "bits", "exact", "version")

    def __init__(self, t, bits=None, exact=False):
        self.t = t
        self.bits = bits  # None: defined; else tuple of (flag tensor, position)
        # zeros whenever undefined: what a call returned (it gives zeros for a None), or a
        # sum of such values; no formula ran on it since, so it needs no mask (`_masked`)
        self.exact = exact
        self.version = t._version if exact else None


def _sum(a: _Value | None, b: _Value | None) -> _Value | None:
    """Two grads for one node input, summed as the engine's InputBuffer sums them: an
    undefined one adds nothing. What a value holds while undefined is zeros at the call
    that flagged it, but a formula may turn zeros into NaN on the way (0 / 0 where x = 0
    in sqrt's), so a value that may be undefined is masked before the add."""
    if a is None:
        return b
    if b is None:
        return a
    bits = None if a.bits is None or b.bits is None else _union(a.bits, b.bits)
    return _Value(_masked(a) + _masked(b), bits, exact=a.exact and b.exact)


def _masked(v: _Value):
    if v.bits is None or (v.exact and v.t._version == v.version):  # (the zeros the mask would add)
        return v.t
    return torch.where(_BackwardTracer._defined(v.bits), v.t, 0.0)


def _union(*bit_sets) -> tuple:
    """The flags of several values, each once: a grad summed from two paths
    that carry the same flags, and every node after it, would otherwise double
    its list at each such sum."""
    seen, out = set(), []
    for bits in bit_sets:
        for b in bits:
            k = (id(b[0]), b[1])
            if k not in seen:
                seen.add(k)
                out.append(b)
    return tuple(out)


class _BackwardTracer:
    def __init__(self, collected: Collected, opaque_extra: dict[int, str], size_inputs=(), layouts=None):
        self.c = collected
        self.layouts = layouts or {}  # (slot, output) -> dim order seen at run time (_layout)
        self.size_inputs = tuple(size_inputs)
        self.sym_sizes = [None] * collected.n_size_inputs
        self.capture = collected.capture
        self.nodes = collected.nodes
        self.opaque_extra = opaque_extra
        self.slots: list = []
        self.at = -1  # the node being traced (Slot.at)
        self.ctx_checks: dict = {}  # slot -> custom Function nodes whose ctx is checked after it
        self.results: list = []
        self.accumulate: list = []
        self.in_graph_accumulate = collected.grad_on_ctx or any(
            (self._is_opaque(i) and self._may_read_grads(i)) or n.hooks.any for i, n in enumerate(self.nodes)
        )

    def _is_opaque(self, idx) -> bool:
        n = self.nodes[idx]
        if n.opaque or idx in self.opaque_extra:
            return True
        info = self.c.pynodes.get(idx)
        return info is not None and info.opaque_reason is not None

    def _may_read_grads(self, idx) -> bool:
        """Whether an opaque node may run code that reads a `.grad` (so AccumulateGrad runs at its
        eager position): a custom Function's backward or a C++ node we know nothing of may; a
        built-in formula (marked opaque, or not traceable on fakes) does not, nor does the
        backward AOTAutograd compiled for a torch.compile'd forward (a compiled graph of aten
        ops between its prologue and epilogue)."""
        if idx in self.c.pynodes:
            return not aot.is_compiled_function(self.capture.node_object(idx)._forward_cls)
        return bool(self.nodes[idx].opaque)

    def opaque_reason(self, idx) -> str:
        n = self.nodes[idx]
        if n.opaque:
            return n.opaque_reason
        if idx in self.opaque_extra:
            return self.opaque_extra[idx]
        return self.c.pynodes[idx].opaque_reason

    # -- graph results -------------------------------------------------------
    def _result(self, v: _Value | None) -> tuple[int, int]:
        if v is None:
            return -1, -1
        self.results.append(v.t)
        self.unconsumed.append(v.t)
        r = len(self.results) - 1
        if v.bits is None:
            return r, -1
        self.results.append(self._defined(v.bits))
        return r, len(self.results) - 1

    @staticmethod
    def _defined(bits):
        if len(bits) == 1:  # the common case (one hook or opaque node upstream): no stack, no reduction
            flag, pos = bits[0]
            return flag[pos]
        return torch.stack([flag[pos] for flag, pos in bits]).any()

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

    # -- opaque calls --------------------------------------------------------
    def _call(self, kind, node, args, out_metas, flags=False, values=None, keeps=None):
        """One compiled_autograd::call; returns the outputs positionally (None where not predicted).

        `values`: the _Values the tensors in `args` come from. Where one may be
        undefined (it carries flags), the call also gets each argument's
        definedness, and passes None for an undefined one, as eager would."""
        mask = tuple(m is not None for m in out_metas)
        slot = len(self.slots)
        in_flags = values is not None and any(v is not None and v.bits is not None for v in values)
        if in_flags:
            args = list(args) + [self._defined_each(values)]
        self.slots.append(Slot(kind, node, mask, in_flags, at=self.at))
        metas = [self._layout(slot, k, m) for k, m in enumerate(m for m in out_metas if m is not None)]
        keeps = flags if keeps is None else keeps
        bits = (ops.DEFINEDNESS if flags else 0) | (ops.KEEPS_INPUTS if keeps else 0) | ops.FREED_NOT_REUSED | ops.DIRECT
        outs = torch.ops.compiled_autograd.call(slot, list(args), ops.encode_meta(metas), bits)
        flag = outs[-1] if flags else None
        it = iter(outs)
        positional = [next(it) if m else None for m in mask]
        return positional, flag

    def _layout(self, slot, k, meta) -> ops.OutputMeta:
        """Output k of call `slot` as the trace predicts it (NOTE [Layouts of call outputs],
        replay/calls.py): in the layout it had at run time when that differed from the prediction
        before (`layouts`), else as given: an OutputMeta, or (shape, dtype, device), contiguous."""
        if not isinstance(meta, ops.OutputMeta):
            shape, dtype, device = meta
            meta = ops.OutputMeta.dense(shape, dtype, torch.device(device))
        return self._seen_layout(meta, self.layouts.get((slot, k)))

    @staticmethod
    def _seen_layout(meta: ops.OutputMeta, seen) -> ops.OutputMeta:
        """`meta` laid out as a backward showed (ops.observed_layout), if it showed one."""
        if seen == "sparse_coo":
            return ops.OutputMeta(meta.shape, meta.dtype, meta.device, [0] * len(meta.shape), torch.sparse_coo)
        if isinstance(seen, tuple) and len(seen) == len(meta.shape):
            return ops.OutputMeta.dense(meta.shape, meta.dtype, meta.device, seen)
        return meta

    def _hook_call(self, kind, idx, values: list, extra=()):
        """One call of a node's hooks on the grads `values` (post hooks also get the
        node's inputs, `extra`). A hook may return None for a grad (a module's full
        backward hook blocking a gradient): the call then returns zeros and a False
        flag, and the grad is defined iff it was before and the flag is set (NOTE
        [Undefined grads of opaque nodes])."""
        tensors = [v.t if v is not None else None for v in values]
        # a hook's result is predicted in its grad's layout (dense: as empty_like lays it out)
        metas = [ops.OutputMeta.like(t) if t is not None else None for t in tensors]
        every = list(values) + list(extra)
        # a tensor hook gets None for an undefined grad and cannot make a defined one
        # undefined (returning None keeps it; giving a tensor for None raises in eager's
        # hook code): what it returns is defined as its input was, and needs no flag (but a
        # call with no tensor at all, where every grad is None, keeps its flag output: a
        # compiler places a call by its tensors' device)
        flags = kind != ops.TENSOR_PRE_HOOKS or all(t is None for t in tensors)
        outs, flag = self._call(kind, idx, [v.t if v is not None else None for v in every], metas, flags=flags, values=every, keeps=True)
        result, k = [], 0
        for o, v in zip(outs, values):
            if o is None:
                result.append(None)
                continue
            if not flags:
                result.append(_Value(o, v.bits, exact=True))
                continue
            if v.bits is None:
                bits = ((flag, k),)
            else:  # defined iff (any of v's flags) and this one
                bits = ((torch.logical_and(self._defined(v.bits), flag[k]).reshape(1), 0),)
            result.append(_Value(o, bits, exact=True))
            k += 1
        return result

    # -- the loop -------------------------------------------------------------
    def run(self, args):
        c, capture = self.c, self.capture
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
        self.in_graph_metas = {}
        self.node_inputs: list = []  # the grads entering the node being traced
        self.unconsumed: list = []  # graph results (grads for AccumulateGrad or grad()) since the last unpack call
        for u in c.in_graph:
            self.in_graph_metas[u.hid] = ops.OutputMeta.dense(dims[: u.dim], u.dtype, u.device, u.order)
            dims = dims[u.dim :]
        unpacked = [args[i] if i >= 0 else None for i in c.unpacked]
        capture.begin_trace(list(args[: c.n_native]), unpacked, self._unpack_in_graph, sym)
        try:
            return self._run(args)
        finally:
            capture.end_trace()

    def _unpack_in_graph(self, hid: int):
        """The native tracer asks for hooked saved tensor `hid` (NOTE [Unpacking in the graph]).

        The call's inputs (unused) say what must be computed before it. The node's incoming
        grads: a compiler may move a call with no inputs to the start of the graph (inductor
        does), which would unpack, and recompute, everything up front again. And the graph
        results computed since the last unpack (grads for AccumulateGrad or grad()): nothing
        inside consumes them, so a compiler may leave them for later (inductor did), keeping
        what they read alive while the next checkpointed region is recomputed; eager
        accumulates each as soon as it is computed."""
        after = [t for t in self.node_inputs if t is not None] + self.unconsumed
        self.unconsumed = []
        (t,), _ = self._call(ops.UNPACK, hid, after, [self.in_graph_metas[hid]])
        return t

    def _run(self, args):
        capture = self.capture
        buffers: dict[int, list] = {}

        def add(idx, nr, v: _Value | None):
            if idx < 0 or v is None:
                return
            buf = buffers.setdefault(idx, [None] * self.nodes[idx].num_inputs)
            buf[nr] = _sum(buf[nr], v)

        roots = capture.roots()
        root_vals = capture.root_values([args[g] if g >= 0 else None for _, _, g in roots])
        for (idx, nr, _), t in zip(roots, root_vals):
            add(idx, nr, None if t is None else _Value(t))

        captured = [(-1, -1)] * capture.num_results()
        for idx, node in enumerate(self.nodes):
            self.at = idx
            hooks, kind = node.hooks, node.kind
            values = buffers.pop(idx, [None] * node.num_inputs)
            # grad() captures what reaches a node: after its tensor pre-hooks when the node
            # does not run, before them when it does (the engine's evaluate_function)
            if not node.execute and (hooks.tensor_pre or hooks.retains):
                values = self._hook_call(ops.TENSOR_PRE_HOOKS, idx, values)
            for nr, out_idx in node.captures:
                captured[out_idx] = self._result(values[nr])
            if not node.execute:
                continue
            # a leaf's tensor hooks and its accumulation: one call (NOTE [A leaf's hooks and
            # its accumulation in one call], replay/calls.py), where its grad is always defined
            hooked = None
            # (not with post hooks on the node: they get the grads the tensor hooks returned)
            if kind == ACCUMULATE_KIND and self.in_graph_accumulate and (hooks.tensor_pre or hooks.retains) and not hooks.pre and not hooks.post:
                v = values[0]
                hooked = v if v is not None and v.bits is None else None
            if (hooks.tensor_pre or hooks.retains) and hooked is None:
                values = self._hook_call(ops.TENSOR_PRE_HOOKS, idx, values)
            if hooks.pre:
                values = self._hook_call(ops.PRE_HOOKS, idx, values)
            in_bits = self._input_bits(values)
            if kind == ACCUMULATE_KIND and hooked is not None:
                self._call(ops.HOOKED_ACCUMULATE, idx, [hooked.t], [])
                outputs = []
            elif kind == ACCUMULATE_KIND:
                self._accumulate(idx, values[0])
                outputs = []
            else:
                outputs = self._apply(idx, kind, values, args)
                outputs = [None if o is None else (o if isinstance(o, _Value) else self._output_value(o, in_bits, values)) for o in outputs]
            if hooks.post:
                outputs = self._post_hooks(idx, outputs, values)
            for (to, nr), v in zip(node.edges, outputs):
                add(to, nr, v)
        return self.results, captured

    @staticmethod
    def _input_bits(values):
        defined = [v for v in values if v is not None]
        if not defined or any(v.bits is None for v in defined):
            return None
        return _union(*(v.bits for v in defined))

    def _accumulate(self, idx, v: _Value | None):
        if self.in_graph_accumulate:
            if v is not None:
                args = [v.t] + ([self._defined(v.bits)] if v.bits is not None else [])
                self._call(ops.ACCUMULATE, idx, args, [])
        else:
            r, f = self._result(v)
            if r >= 0:
                self.accumulate.append((idx, r, f))

    def _post_hooks(self, idx, outputs, inputs):
        return self._hook_call(ops.POST_HOOKS, idx, outputs, inputs)

    def _apply(self, idx, kind, values, args):
        if self._is_opaque(idx):
            return self._opaque_node(idx, values)
        tensors = [v.t if v is not None else None for v in values]
        if kind == PYNODE_KIND:
            if not self.c.pynodes[idx].flags[0] and any(v is not None and v.bits is not None for v in values):
                # its backward sees None for an undefined grad, and may branch on it
                raise NeedsOpaque(idx, "set_materialize_grads(False) and a grad that may be None at run time")
            out = self._pynode(idx, tensors, args)
            # the trace read this ctx's attributes, and the globals and closures its backward
            # reads, as they were when the backward started; the last call before it checks
            # that no hook has rebound one since (Plan.ctx_checks)
            last = next((i for i in range(len(self.slots) - 1, -1, -1) if self.slots[i].kind != ops.UNPACK), None)
            node = self.capture.node_object(idx)
            if last is not None and (vars(node) or state_reads(node._forward_cls)):
                self.ctx_checks.setdefault(last, []).append(idx)
            return out
        defined = [v for v in values if v is not None]
        if len(defined) > 1 and any(v.bits is not None for v in defined):
            # a formula given an undefined grad beside others skips its terms; on the zeros
            # standing in for it, 0 * inf in such a term would be NaN (var_mean's var term
            # with one element). The node runs as is, given None where eager gives None.
            # (Inline: a flag means a hook or an opaque node is already in the graph.)
            self.opaque_extra[idx] = "a grad that may be None at run time, beside others"
            return self._opaque_node(idx, values)
        try:
            self.node_inputs = tensors
            return self.capture.apply_node(idx, tensors)
        except Exception as e:
            # a formula that cannot run on fake tensors (data-dependent output
            # shapes, a missing meta kernel, a functional bound by another
            # compiler): that node runs as is, the rest stays compiled
            first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise NeedsOpaque(idx, f"not traceable: {first}") from e

    @staticmethod
    def _output_value(o, in_bits, values) -> _Value:
        """A node's output: exact (zeros whenever undefined) when it is an exact input the
        node hands through as it is (BackwardHookFunction's backward, AddBackward's), not
        changed in place since (a backward may return `g.div_(x)`: its version moved)."""
        exact = in_bits is not None and any(v is not None and v.exact and o is v.t and o._version == v.version for v in values)
        return _Value(o, in_bits, exact=exact)

    def _opaque_node(self, idx, values):
        edges, edge_sizes = self.nodes[idx].edges, self.nodes[idx].edge_sizes
        metas = []
        for k, ((to, nr), pos) in enumerate(zip(edges, edge_sizes)):
            m = None
            md = self.capture.input_metadata(to)[nr] if to >= 0 else None
            if md is not None:
                # the output's shape, symbolic where the edge's metadata sizes are; laid out
                # as an eager backward showed (NOTE [Layouts of call outputs], replay/calls.py)
                shape, dtype, device = md
                dims = [v if self.sym_sizes[pos + d] is None else self.sym_sizes[pos + d] for d, v in enumerate(shape)]
                m = self._seen_layout(ops.OutputMeta.dense(dims, dtype, torch.device(device)), self.layouts.get(("node", idx, k)))
            metas.append(m)
        tensors = [v.t if v is not None else None for v in values]
        outs, flag = self._call(ops.NODE, idx, tensors, metas, flags=True, values=values)
        result, k = [], 0
        for o in outs:
            if o is None:
                result.append(None)
            else:
                result.append(_Value(o, ((flag, k),), exact=True))
                k += 1
        return result

    def _pynode(self, idx, grads, args):
        info = self.c.pynodes[idx]
        capture = self.capture
        node = capture.node_object(idx)
        materialize, materialize_non_diff, _, is_variable_input = info.flags
        metas = capture.input_metadata(idx)
        output_info = capture.pynode_output_info(idx)
        inputs = []
        # PyNode::apply: undefined grads become zeros shaped like the forward
        # output, unless materialization is off (also for non-differentiable
        # outputs, separately)
        pos = self.nodes[idx].size_start  # the outputs' sizes are the node's size inputs (symbolic if dynamic)
        for g, m, info_i in zip(grads, metas, output_info):
            if info_i is None:
                inputs.append(g)
                continue
            shape, dtype, device = info_i
            dims = [v if self.sym_sizes[pos + d] is None else self.sym_sizes[pos + d] for d, v in enumerate(shape)]
            pos += len(shape)
            if g is None and materialize and (m is not None or materialize_non_diff):
                g = torch.zeros(dims, dtype=dtype, device=device)
            inputs.append(g)
        if info.flags[2]:
            out = self._aot_backward(idx, node, inputs, args)
        else:
            out = self._python_backward(idx, node, info, inputs, args)
        if not isinstance(out, tuple):
            out = (out,)
        return self._pynode_results(idx, out, is_variable_input)

    def _aot_backward(self, idx, node, grads, args):
        """NOTE [Inlining AOTAutograd backwards] (nodes/compiled_region.py)."""
        if torch.is_grad_enabled():
            raise NeedsOpaque(idx, "a torch.compile'd region's backward under create_graph (AOTAutograd has no double backward)")
        info = self.c.pynodes[idx]
        saved = [args[i] if i >= 0 else None for i in info.saved]
        symints = aot.rebuild_symints(info.symints, self.aot_ints[info.aot_start :])
        try:
            _tracing.active = True
            try:
                return aot.trace_backward(node._forward_cls, symints, saved, grads)
            finally:
                _tracing.active = False
        except Exception as e:
            raise NeedsOpaque(idx, f"a torch.compile'd region's backward not traceable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")

    def _python_backward(self, idx, node, info, inputs, args):
        capture_swap = None
        originals = {}
        try:
            from .. import native

            capture_swap = native.load().PyNodeSavedSwap(node, [args[i] if i >= 0 else None for i in info.saved])
            kept = [args[i] for i in info.saved if i >= 0] + [args[i] for _, _, i in info.read]
            ints = iter(self.aot_ints[info.aot_start :])  # NOTE [Sizes kept on ctx] (walk/collect.py)
            for name, value in info.attrs:
                originals[name] = vars(node)[name]
                rebuilt = _rebuild(fill_sizes(value, ints), self.c, args)
                setattr(node, name, rebuilt)
                kept += _tensors(rebuilt)
            versions = [t._version for t in kept]
            _tracing.active = True
            try:
                with _ConstantsWithoutGradMode() if torch.is_grad_enabled() else contextlib.nullcontext():
                    if info.read:  # NOTE [Tensors a backward reads from globals and closures]
                        # (_get_user_fn: eager's own error for a Function with both backward and vjp)
                        user = node._get_user_fn() if hasattr(node, "_get_user_fn") else user_backward(node._forward_cls)
                        fn = swapped(getattr(user, "__func__", user), {(w, name): args[i] for w, name, i in info.read})
                        out = fn(node, *inputs)  # (what BackwardCFunction.apply calls)
                    else:
                        out = node.apply(*inputs)
            finally:
                _tracing.active = False
            if any(t._version != v for t, v in zip(kept, versions)):
                # the graph's functional code would leave that change invisible to the hooks
                # after it (a compiler writes a changed graph input back at the end): the node
                # runs as is, in its place
                raise NeedsOpaque(idx, "its backward changes in place a tensor it saved or keeps on ctx")
        except NeedsOpaque:
            raise
        except Exception as e:
            raise NeedsOpaque(idx, f"{node.name()} backward not traceable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        finally:
            for name, value in originals.items():
                setattr(node, name, value)
            if capture_swap is not None:
                capture_swap.restore()
        return out

    def _pynode_results(self, idx, out, is_variable_input):
        capture = self.capture
        n_forward = len(is_variable_input)
        if len(out) > n_forward and all(o is None for o in out[n_forward:]):
            out = out[:n_forward]
        if len(out) != n_forward:
            raise NeedsOpaque(idx, "backward returned a wrong number of gradients")
        results = []
        for o, is_var in zip(out, is_variable_input):
            if not is_var:
                if o is not None:
                    raise NeedsOpaque(idx, "gradient for a non-tensor input")
                continue
            if o is not None and not isinstance(o, torch.Tensor):
                raise NeedsOpaque(idx, "backward returned a non-tensor")
            results.append(o)
        return capture.validate(idx, results)


class _ConstantsWithoutGradMode(torch.overrides.TorchFunctionMode):
    """NOTE [Ops without grad mode under create_graph]
    A create_graph trace records aten ops, not grad mode, and the second order
    differentiates the recorded graph (NOTE [create_graph]). So what a custom
    backward computes with grad mode off (under `no_grad`, or all of it when
    `once_differentiable` gets grads that do not require grad) would be
    differentiated, where eager's results are constants for the next order. Around
    a custom backward traced in grad mode, each op that runs without grad mode on
    a tensor that requires grad has its results cut with `detach` in the graph. An
    in-place op there (on a tensor that requires grad, or with one) leaves in eager
    a history the graph cannot express: the node cannot be traced, and create_graph
    falls back."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            return func(*args, **kwargs)
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in tensors]
        out = func(*args, **kwargs)
        if not any(t.requires_grad for t in tensors):
            return out
        if any(t._version != v for t, v in zip(tensors, versions)):
            raise RuntimeError("an in-place op without grad mode, on a tensor that requires grad or with one (create_graph)")

        def cut(o):
            if not isinstance(o, torch.Tensor) or o.requires_grad or not (o.is_floating_point() or o.is_complex()):
                return o  # (an op that returns its input as is, `x.to(x.dtype)`, keeps its history in eager too)
            return o.detach()

        return torch.utils._pytree.tree_map(cut, out)


def _rebuild(value, collected: Collected, args):
    """A ctx attribute with its (real) tensors replaced by the tracer's fakes."""
    lifted_index = {id(t): i for i, t in enumerate(collected.lifted)}

    def go(v):
        if isinstance(v, torch.Tensor):
            return args[lifted_index[id(v)]]
        if isinstance(v, (tuple, list)):
            return type(v)(go(x) for x in v)
        if isinstance(v, dict):
            return {k: go(x) for k, x in v.items()}
        return v

    return go(value)


@dataclass
class Captured:
    graph: torch.fx.GraphModule
    plan: Plan
    example_inputs: list  # fake tensors (and SymInts of dynamic size inputs) the graph was traced with
    mask: tuple | None  # per size position: symbolic? (None: static graph)
    size_inputs: tuple  # size-input positions that are graph inputs
    guard_source: str | None
    shape_env: ShapeEnv


class _SizeEnv(ShapeEnv):
    """The ShapeEnv of a dynamic capture: it decides, per size position, what
    each size, stride and storage offset of the lifted tensors becomes.

    NOTE [One symbol per size class]
    Positions that did not change across the backwards of this key stay
    static, so kernels keep their constant dims (a head dim of 16, a d_model
    of 64): only what changed becomes symbolic. By default every symbolic
    position would get its own symbol: the batch dim of each saved tensor,
    each saved `sym_sizes`, each stride. They are one size of the model, but a
    compiler that cannot prove them equal emits indexing with divisions and
    modulos over several symbols and no vectorization (a transformer's
    select_backward kernel: 15 ms against 0.5 ms static). So positions that
    held equal values in every backward seen so far (this one and each cached
    entry of the key) form a class and share one symbol; the equalities become
    guards (duck sizing, with a history instead of one value, so that a
    coincidence in one backward does not merge two sizes). A guard that fails
    is a miss, and the next capture, with one more backward of history,
    splits the class."""

    def __init__(self, classes: dict[str, Any]):
        super().__init__()
        self._classes = classes  # source name -> class, or None: static
        self._symbol_of_class: dict[Any, Any] = {}

    def create_symbol(self, val, source, dynamic_dim=DimDynamic.DUCK, *args, **kwargs):
        name = source.name
        if name not in self._classes or dynamic_dim is DimDynamic.STATIC or not isinstance(val, int):
            return super().create_symbol(val, source, dynamic_dim, *args, **kwargs)
        cls = self._classes[name]
        if cls is None:
            return sympy.Integer(val)
        # duck sizing keyed by our class instead of by the value alone
        self.val_to_var.pop(val, None)
        if cls in self._symbol_of_class:
            self.val_to_var[val] = self._symbol_of_class[cls]
        try:
            r = super().create_symbol(val, source, DimDynamic.DUCK, *args, **kwargs)
        finally:
            self.val_to_var.pop(val, None)
        if isinstance(r, sympy.Symbol):
            self._symbol_of_class.setdefault(cls, r)
        return r


def _size_classes(collected: Collected, mask, history) -> dict[str, Any]:
    """Source name of every size position -> None where `mask` keeps it
    static, else its class: its value in this backward and in each of
    `history` (the sizes of earlier backwards of the key)."""
    sizes = collected.sizes
    names = [LocalSource(f"size{j}").name for j in range(collected.n_size_inputs)]
    for i, (start, dim, with_strides) in enumerate(collected.tensor_positions):
        base = LocalSource(f"lifted{i}")
        names += [TensorPropertySource(base, TensorProperty.SIZE, d).name for d in range(dim)]
        if with_strides:
            names += [TensorPropertySource(base, TensorProperty.STRIDE, d).name for d in range(dim)]
        names.append(TensorPropertySource(base, TensorProperty.STORAGE_OFFSET).name)
    names += [source.name for source in _aot_sources(collected)]
    names += [source.name for source in _in_graph_sources(collected)]
    assert len(names) == len(sizes), (len(names), len(sizes))
    history = [h for h in history if len(h) == len(sizes)]
    return {
        name: ((sizes[p],) + tuple(h[p] for h in history) if mask[p] else None) for p, name in enumerate(names)
    }


def _aot_sources(collected: Collected) -> list:
    """A source per int an inlined AOTAutograd backward reads (NOTE [Inlining AOTAutograd backwards])."""
    return [LocalSource(f"aot{k}") for k in range(collected.n_aot)]


def _in_graph_sources(collected: Collected) -> list:
    """A source per dim of the tensors unpacked in the graph (NOTE [Unpacking in the graph])."""
    return [LocalSource(f"unpacked{u.hid}_{d}") for u in collected.in_graph for d in range(u.dim)]


# NOTE [No item symbols for lifted scalars]
# A fake tensor made from a 0-dim CPU tensor of an int type or float64 with a
# source gets an `.item()` symbol (FakeTensorMode.from_tensor: its item_memo), as
# dynamo wants for Python scalars it passes as tensors. Ours are saved tensors
# (MulBackward0's `other` when it is a 0-dim tensor): nothing of ours guards such
# a symbol, so a formula that read the value (`.item()`) would have traced this
# backward's value unguarded; and AOTAutograd's float-tensorify pass, finding a
# float symbol it did not make, asks dynamo to restart with it specialized,
# which here failed every dynamic capture of such a graph (TensorifyScalar-
# RestartAnalysis: a new static capture per size, an error under fullgraph=True;
# found by tests/test_fuzz.py). So 0-dim lifted tensors are fakeified without a
# source: no symbol, and a formula that reads the value raises, which makes its
# node opaque.
def fakeable(t: torch.Tensor) -> torch.Tensor:
    """NOTE [Views that change the dtype]
    torch 2.13 fakeifies a view by replaying it on its base's fake, and fails for
    a view of another dtype (`view_as_complex(x.view(-1, 2))` saved by `.abs()`:
    "Tensor must have a last dimension of size 2"). Such a lifted tensor is
    fakeified as what it is to the graph: a tensor of its geometry on the same
    storage (so the fakes still share a storage), not a view. The graph reads it;
    what a write into it would do to the base is not traced, but nothing in a
    backward graph writes into a lifted tensor."""
    if t._is_view() and t._base.dtype != t.dtype:
        alias = t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
        return alias.requires_grad_(t.requires_grad) if t.requires_grad else alias
    return t


def fake_inputs(collected: Collected, mask, history=()):
    """Fake versions of the lifted tensors, and SymInts for the size inputs
    marked in `mask`; every other size, stride and offset stays static
    (strides that follow from symbolic sizes become expressions of them).
    Marked positions equal in this backward and in every one of `history`
    share a symbol (NOTE [One symbol per size class]). Returns also the mask
    of positions that really are symbolic (a 0/1 size, for one, is
    specialized)."""
    shape_env = _SizeEnv(_size_classes(collected, mask, history) if mask else {})
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
    sizes, n_si = collected.sizes, collected.n_size_inputs
    real_mask = [False] * len(sizes)
    fakes = []
    for i, (t, (start, dim, with_strides)) in enumerate(zip(collected.lifted, collected.tensor_positions)):
        # with a mask every dim asks the env, which answers per position; so
        # do recorded strides (torch would otherwise infer a stride from any
        # size product of equal value, a coincidence of this one backward)
        dims = [DimDynamic.DYNAMIC if mask else DimDynamic.STATIC] * dim
        strides = [DimDynamic.DYNAMIC if mask and with_strides else DimDynamic.INFER_STRIDE] * dim
        context = StatelessSymbolicContext(dynamic_sizes=dims, dynamic_strides=strides, constraint_sizes=[None] * dim)
        # (no source for a 0-dim tensor: fakeifying a 0-dim CPU int or float64 tensor with a
        # source gives it an `.item()` symbol, whose value nothing here guards (NOTE [No
        # item symbols for lifted scalars]); it has no size or stride, and its offset stays static)
        source = LocalSource(f"lifted{i}") if dim > 0 else None
        f = mode.from_tensor(fakeable(t), symbolic_context=context if dim > 0 else None, source=source)
        geo = list(f.shape) + (list(f.stride()) if with_strides else []) + [f.storage_offset()]
        for k, g in enumerate(geo):
            real_mask[start + k] = isinstance(g, torch.SymInt)
        fakes.append(f)
    # the node sizes, and the shapes of the tensors unpacked in the graph: ints passed in
    sources = [(j, LocalSource(f"size{j}")) for j in range(n_si)]
    sources += [(collected.aot_start + k, source) for k, source in enumerate(_aot_sources(collected))]
    sources += [(collected.in_graph_start + k, source) for k, source in enumerate(_in_graph_sources(collected))]
    symints, size_inputs = [], []
    for j, source in sources:
        if mask and mask[j]:
            v = shape_env.create_unspecified_symint_and_symbol(sizes[j], source, DimDynamic.DYNAMIC)
            if isinstance(v, torch.SymInt):
                symints.append(v)
                size_inputs.append(j)
                real_mask[j] = True
    return mode, shape_env, fakes, symints, tuple(size_inputs), tuple(real_mask) if mask else None


def capture_backward(collected: Collected, opaque_names: tuple = (), mask=None, history=(), create_graph=False, layouts=None) -> Captured:
    """Trace the whole backward (symbolic where `mask` says; `history`: the
    sizes of earlier backwards of this key); nodes that cannot be traced
    become opaque. With `create_graph`, the formulas run in grad mode, as the
    engine runs them then, on fakes that require grad where the real tensors do."""
    opaque_extra: dict[int, str] = {
        i: "marked opaque" for i, n in enumerate(collected.nodes) if n.name in opaque_names and n.kind != ACCUMULATE_KIND
    }
    for _ in range(MAX_OPAQUE_RETRIES):
        mode, shape_env, fakes, symints, size_inputs, real_mask = fake_inputs(collected, mask, history)
        tracer = _BackwardTracer(collected, opaque_extra, size_inputs, layouts)
        out: dict[str, Any] = {}

        def backward_graph(*args):
            results, captured = tracer.run(args)
            out["captured"] = captured
            return results

        grad_mode, collected.capture.grad_mode = collected.capture.grad_mode, create_graph
        try:
            with torch.set_grad_enabled(create_graph), mode, _quiet_fake_tensor_errors():
                gm = make_fx(backward_graph, tracing_mode="real", _allow_non_fake_inputs=False)(*fakes, *symints)
        except NeedsOpaque as e:
            opaque_extra[e.idx] = e.reason
            continue
        finally:
            collected.capture.grad_mode = grad_mode
        differentiable = None
        if create_graph:
            differentiable = tuple(isinstance(r, torch.Tensor) and r.requires_grad for r in tracer.results)
            error = once_differentiable(tracer.results, fakes)
            if error is not None:
                raise NotTwiceDifferentiable(error)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        opaque = tuple(
            (i, tracer.nodes[i][0], tracer.opaque_reason(i))
            for i in range(len(tracer.nodes))
            if tracer.nodes[i][2] and tracer._is_opaque(i)
        )
        slots, watch = _order_reads_before_calls(
            gm, _mark_shared_args(gm, _mark_fresh_grads(gm, tracer.slots)), _version_checked(collected), _passable(collected)
        )
        plan = Plan(
            slots=slots,
            watch=watch,
            ctx_checks=tuple((slot, tuple(idxs)) for slot, idxs in tracer.ctx_checks.items()),
            accumulate=tuple(tracer.accumulate),
            captured=tuple(out["captured"]),
            opaque=opaque,
            num_results=len(tracer.results),
            differentiable=differentiable,
            releases=_releases(tracer.slots, tracer.nodes),
        )
        return Captured(gm, plan, fakes + symints, real_mask, size_inputs, None, shape_env)
    raise RuntimeError("compiled_autograd: could not trace this backward")


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


def _releases(slots, nodes) -> tuple:
    """Plan.releases: (slot, node indices) per call after which those executed nodes' saved
    variables are freed (NOTE [Saved tensors freed as eager frees them])."""
    reading = []  # (node, slot) of each call that may read saved tensors
    for s, (kind, node, *_) in enumerate(slots):
        if kind in (ops.UNPACK, *ops.ACCUMULATES):
            continue
        if kind != ops.NODE:
            if nodes[node][1] == ACCUMULATE_KIND:
                continue
            if nodes[node][0] == "BackwardHookFunctionBackward":  # a module's full backward hooks
                continue
        reading.append((node, s))
    reading.sort()
    after: dict[int, list] = {}
    last, j = -1, 0
    for k in range(len(nodes)):
        while j < len(reading) and reading[j][0] <= k:
            last = max(last, reading[j][1])
            j += 1
        if nodes[k][2]:
            after.setdefault(last, []).append(k)
    if not reading:
        return ()  # every node's before the graph runs
    return tuple((s, tuple(ks)) for s, ks in sorted(after.items()))


def _mark_fresh_grads(gm: torch.fx.GraphModule, slots: list) -> tuple:
    """Mark the ACCUMULATE calls whose grad is memory the graph itself made: an op's
    result, or a view of one, rather than (a view of) a graph input, which is a tensor
    the user or the autograd graph still holds, and that nothing else in the graph reads
    (`_read_only_here`). In the plan (the slot's `fresh`) and in
    the graph (the call's flags get ops.HANDS_OVER: inductor's lowering of the call then
    keeps that buffer from reuse). NOTE
    [Stealing a fresh grad], replay/calls.py."""
    slots = list(slots)
    marked = False
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.compiled_autograd.call.default:
            continue
        slot = n.args[0]
        if slots[slot][0] not in ops.ACCUMULATES or not n.args[1] or not isinstance(n.args[1][0], torch.fx.Node):
            continue
        if _read_only_here(n.args[1][0]):
            slots[slot] = slots[slot]._replace(fresh=True)
            c = ops.CallArgs.of(n)
            n.args = tuple(c._replace(flags=c.flags | ops.HANDS_OVER))
            marked = True
    if marked:
        gm.recompile()
    return tuple(slots)


def _version_checked(collected) -> frozenset:
    """The lifted indices of tensors eager checks the version of when a node unpacks them:
    saved variables of built-in nodes and custom Functions' save_for_backward (not root
    grads, tensors kept on ctx, or what unpack hooks returned)."""
    c = collected.capture
    # (0-dim ones are left out: a wrapped number, `x * 2`'s 2, reaches a call as a Python number)
    out = {i for i, t in enumerate(collected.lifted[: collected.n_native]) if isinstance(t, torch.Tensor) and t.dim() > 0}
    out -= {g for _, _, g in c.roots() if g >= 0}
    for info in collected.pynodes.values():
        out.update(i for i in info.saved if i >= 0 and collected.lifted[i].dim() > 0)
    # (a tensor also kept on ctx stays checked: the node that saved it checks it)
    out -= set(collected.up_front)
    return frozenset(out)


def _passable(collected) -> frozenset:
    """The lifted indices of the tensors a call passes on when read after it (NOTE [Hooks
    may change what the graph reads]): those eager reads as they are when their node runs,
    without a version check, which a hook before may have changed: root grads, tensors kept
    on ctx, what unpack hooks returned up front (not 0-dim ones: wrapped numbers among them
    reach a call as Python numbers). Saved tensors are checked instead (`n_watch`): passing
    them on would keep each alive to the end of an inductor graph, which never frees an
    output it must not reuse (+17% peak memory on the hooked benchmark)."""
    out = {g for _, _, g in collected.capture.roots() if g >= 0}
    out |= kept_indices(collected.pynodes, collected.lifted)
    out |= {i for i in collected.up_front if collected.lifted[i].dim() > 0}
    return frozenset(out)


def _order_reads_before_calls(
    gm: torch.fx.GraphModule, slots: tuple, checked: frozenset = frozenset(), passable: frozenset = frozenset()
) -> tuple:
    """NOTE [Hooks may change what the graph reads]
    A hook can change a tensor the graph reads: the optimizer-in-backward recipe steps
    each parameter in place from its post-accumulate-grad hook, as soon as its grad is
    ready. In eager, every node the engine ran before the hook read the old values (a
    node after it that saved the tensor raises: its version changed). The traced graph
    has eager's order, but a compiler only keeps what the data flow and the calls'
    ORDERED effect require: inductor moved a layer's `grad @ W` past the hook that
    steps W (the weights were off by 10 after 3 steps). So every op that reads a graph
    input (a lifted tensor: saved tensors, parameters; directly or through a view) and
    comes before a call in the traced order becomes an argument of that call, unused by
    it, which orders the read before the call, as the unpack calls' arguments do (the
    last `n_after` arguments: ops.call drops them). Calls are ordered among themselves,
    so each call needs only the reads since the one before it.
    Reads after a call: a saved tensor that a hook changed before its node runs is eager's
    version-counter error: the last call before a saved tensor's last read also takes it
    (`n_watch`, `Plan.watch`) and raises that error if its version is not the one it had
    when the backward started (versions only grow, so one check covers every call before).
    A graph input eager reads without that check (a tensor kept on a custom Function's
    ctx, a root grad) is read as it is when its node runs, changes included. So an op that
    reads one after a hook or opaque call reads it from that call: the last such call
    before the op takes the tensor as an argument and returns it as an output (the last
    `flags >> ops.PASSES_SHIFT` of each; the same tensor with eager, aot_eager and inductor,
    whose lowering keeps the call's output buffers from reuse (they are graph inputs); a copy
    with a user's backend), so the read depends on the call (`_passable`). Unpack calls are
    not hooks and pass nothing. (A saved tensor changed through `.data`, which bumps no
    version, may still be read before the hook by inductor.)
    Returns the slots and Plan.watch."""
    from ..capture.create_graph import _aliases

    call = torch.ops.compiled_autograd.call.default
    slots = list(slots)
    inputs: dict = {}  # tensor placeholders and views of them -> the placeholder
    pending: list = []  # tensors computed since the last call by ops that read one
    calls: list = []  # the call nodes, in order
    last_call: dict = {}  # checked placeholder -> the last call before its last read
    hook_call = None  # the last call that is not an unpack
    passes: dict = {}  # call -> {what it passes on: its output}
    since: dict = {}  # a view or passed input -> the hook call before it (None: before any)
    changed = False
    position = 0

    def passed(c, a):
        """`a` (an unchecked graph input, or a view of one) as call `c` returns it."""
        mine = passes.setdefault(c, {})
        if a not in mine:
            call_args = ops.CallArgs.of(c)
            first = call_args.n_outputs + (1 if call_args.flags & ops.DEFINEDNESS else 0)
            with gm.graph.inserting_after(c):
                g = gm.graph.call_function(operator.getitem, (c, first + len(mine)))
            g.meta["val"] = a.meta.get("val")
            inputs[g] = inputs[a]
            since[g] = c
            mine[a] = g
        return mine[a]

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if isinstance(n.meta.get("val"), torch.Tensor):
                inputs[n] = (n, position)
            position += 1
            continue
        if n.op != "call_function":
            continue
        if n.target is call:
            args = list(n.args[1])
            direct = {a for a in args if isinstance(a, torch.fx.Node)}
            after = [r for r in dict.fromkeys(pending) if r not in direct]
            if after:
                n.args = (n.args[0], args + after, *n.args[2:])
                slot = n.args[0]
                slots[slot] = slots[slot]._replace(n_after=len(after))
                changed = True
            pending = []
            calls.append(n)
            if slots[n.args[0]].kind != ops.UNPACK:
                hook_call = n
            continue
        if hook_call is not None:
            for a in list(n.all_input_nodes):
                if a in inputs and inputs[a][1] in passable and since.get(a) is not hook_call:
                    n.replace_input_with(a, passed(hook_call, a))
                    changed = True
        read = [inputs[a] for a in n.all_input_nodes if a in inputs]
        if not read:
            continue
        if _aliases(n) and n.args and n.args[0] in inputs:
            inputs[n] = inputs[n.args[0]]  # a view: read by the ops that take it
            since[n] = hook_call
            continue
        if calls:
            for placeholder, lifted in read:
                if lifted in checked:
                    last_call[placeholder] = (calls[-1], lifted)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            pending.append(n)
        elif isinstance(val, (tuple, list)):  # a multi-output op: any of its tensors orders it
            pending.extend([u for u in n.users if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)][:1])
    by_call: dict = {}
    for placeholder, (c, lifted) in last_call.items():
        by_call.setdefault(c, []).append((placeholder, lifted))
    watch = []
    for c, items in by_call.items():
        slot = c.args[0]
        c.args = (slot, list(c.args[1]) + [p for p, _ in items], *c.args[2:])
        slots[slot] = slots[slot]._replace(n_watch=len(items))
        watch.append((slot, tuple(i for _, i in items)))
        changed = True
    for c, mine in passes.items():  # after the watched tensors: ops.call takes them off first
        call_args = ops.CallArgs.of(c)
        c.args = tuple(call_args._replace(args=list(call_args.args) + list(mine), flags=call_args.flags | (len(mine) << ops.PASSES_SHIFT)))
        if isinstance(c.meta.get("val"), (list, tuple)):
            c.meta["val"] = [*c.meta["val"], *(g.meta["val"] for g in mine.values())]
    if changed:
        gm.recompile()
    return tuple(slots), tuple(watch)


def _mark_shared_args(gm: torch.fx.GraphModule, slots: tuple) -> tuple:
    """The arguments of each hook call and opaque node call that something else in the
    graph reads too (`Slot.shared`). PyTorch's hooks must not modify their arguments
    (they may return a new gradient instead), but in eager one that does changes the
    tensor for every node the engine runs after it; a compiler may have read it before.
    ops.call raises if such an argument's version changed rather than follow either."""
    call = torch.ops.compiled_autograd.call.default
    slots = list(slots)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not call:
            continue
        slot = slots[n.args[0]]
        if slot.kind not in (ops.TENSOR_PRE_HOOKS, ops.PRE_HOOKS, ops.POST_HOOKS, ops.NODE, ops.HOOKED_ACCUMULATE):
            continue
        args = list(n.args[1])[: len(n.args[1]) - slot.in_flags]
        shared = tuple(
            i for i, a in enumerate(args)
            if isinstance(a, torch.fx.Node) and (args.count(a) > 1 or not _read_only_here(a, inputs_ok=True))
        )
        slots[n.args[0]] = slot._replace(shared=shared)
    return tuple(slots)


def _read_only_here(grad: torch.fx.Node, inputs_ok: bool = False) -> bool:
    """Whether `grad` is memory the graph made (an op's result or a view of one, not a
    view of a graph input) that nothing in the graph reads but the one call taking it:
    no other view of it, no other reader of it or of its base, not a graph result. A
    hook may change `.grad` in place, which must not change what the graph computes
    afterwards; eager's AccumulateGrad copies a grad its engine still holds for another
    node (AddBackward gives both its edges one tensor)."""
    from ..capture.create_graph import _aliases

    n = grad
    while True:
        if len(n.users) != 1:
            return False
        if n.op != "call_function":
            return inputs_ok and n.op == "placeholder"  # `inputs_ok`: a graph input counts as made
        if not _aliases(n):
            return True  # the op that made it
        parent = n.args[0] if n.args else None
        if not isinstance(parent, torch.fx.Node):
            return False
        if n.target is operator.getitem and parent.op == "call_function" and not _aliases(parent):
            # one result of a multi-output op: its other results are other tensors
            return all(u is n or (u.target is operator.getitem and u.args[1] != n.args[1]) for u in parent.users)
        n = parent


class NotTwiceDifferentiable(Exception):
    """create_graph=True through a part of the backward eager records as an error node."""


def once_differentiable(results, inputs) -> str | None:
    """The name of an error node in the autograd graph the traced (fake) results
    were recorded with, if any: eager records the same node (a once_differentiable
    custom Function's DelayedError, a formula's not_implemented) and raises when a
    second backward reaches it. The graph ends at the fake inputs (a fake of a
    non-leaf hangs off an error node of its own, which is not the backward's)."""
    seen: dict[int, Any] = {id(t.grad_fn): t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    stack = [r.grad_fn for r in results if isinstance(r, torch.Tensor) and r.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn  # (keeps it alive, so the id stays unique)
        name = fn.name()
        if "Error" in name or "NotImplemented" in name:
            return name
        stack.extend(f for f, _ in fn.next_functions)
    return None


def guards_of(captured: Captured):
    """The guard expression of a dynamic capture, after compilation (backends
    may add guards to the same ShapeEnv) and a compiled evaluator for it."""
    if captured.mask is None:
        return None, None
    source = captured.shape_env.produce_guards_expression(captured.example_inputs)
    if source is None:
        return None, None
    code = compile(source, "<compiled_autograd guards>", "eval")
    return source, lambda L: eval(code, SYMPY_INTERP, {"L": L})
