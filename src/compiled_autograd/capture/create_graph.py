"""Compiled backwards that are themselves differentiable (create_graph=True).

NOTE [create_graph]
With `create_graph=True` eager runs every formula in grad mode, so the
backward's own ops are recorded and the gradients it returns (or accumulates
into `.grad`) can be differentiated again: gradient penalties, Hessian-vector
products, meta-learning. Ours:

  * trace: the formulas run in grad mode too, on fakes that require grad where
    the real lifted tensors do (a formula may branch on grad mode; most pick
    out-of-place ops then). The fakes' autograd graph tells, per graph result,
    whether eager's would require grad (`Plan.differentiable`), and whether
    eager recorded an error node that a second backward raises
    (once_differentiable custom Functions, not_implemented formulas): then
    the whole backward runs eagerly, so the error is eager's.
  * run: the compiled graph runs without grad inside one autograd Function,
    `DifferentiableGraph`, whose inputs are the lifted tensors (saved tensors
    unpacked with their grad_fn, root grads, leaves), so its outputs are
    connected to everything the backward read, as eager's are. Results eager
    would not make differentiable are marked non-differentiable.
  * its backward, the second-order pass, is the traced graph differentiated
    by eager's engine. At capture, that is traced once more as a joint
    function, (inputs, cotangents) -> (results, vjp), and split
    (`split_joint`): what depends only on the inputs becomes the graph that
    is compiled and run (results plus the intermediates the vjp reads, saved
    as eager's create_graph saves them), the rest the vjp graph, run by the
    Function's backward. A second backward under `enable()` traces that vjp
    graph into its own graph, so it is compiled as well. Each input is its own
    leaf in the joint: lifted tensors may be views of each other (torch.cov
    saves x and x.t()), and the engine sends a view's gradient into its base
    after the Function returns; the vjp must not do it too.
  * under create_graph again (third and higher orders), or when the split could
    reorder a mutation (`_split`), the backward reruns the traced graph in grad
    mode on clones of the real inputs (connected to their history, one leaf
    each) and differentiates that, so every order works as in eager.
  * AccumulateGrad applies the results in grad mode: it clones into `.grad`
    and adds out of place, as eager does under create_graph.

What it does not take (falls back, with its reason): hooks other than a leaf's
own (below), opaque nodes and saved-tensor hooks (their calls would run again, or
return tensors without their autograd history). Its graphs are static (each new
size is a new graph) and are not stored on disk.

NOTE [A leaf's hooks under create_graph]
A leaf's tensor hooks (`param.register_hook`) and post-accumulate-grad hooks run
in its AccumulateGrad's step, and what they see and return goes nowhere but into
its `.grad`: nothing in the graph reads it. So under create_graph they need no
call inside the graph (which the differentiable graph cannot have): the leaf's
grad is a graph result, and after the graph each leaf, in engine order, gets its
tensor hooks called on that result (in grad mode, as the engine calls them then:
the hooks see, and may return, a tensor with its history) and then its
AccumulateGrad, which runs its post-accumulate-grad hooks. Nothing else of the
backward is observable to them that eager would show otherwise: no other hook or
opaque node runs (those fall back), and only AccumulateGrad writes a `.grad`, in
the same order. A leaf's hooks when `inputs=` captures its grad instead
(`torch.autograd.grad`) are still a call in the graph: that falls back.

A user's backend's code may write into a grad it handed over, so AccumulateGrad in its graph
copies (NOTE [Stealing a fresh grad], nodes/accumulate.py), where eager steals. Where the leaves
whose hooks are their own come last in engine order -- no node but an AccumulateGrad after them,
so nothing of the graph computes after their hooks, which may change what it reads -- their
grads are results too, and AccumulateGrad takes each after the graph, stealing where eager does
(torch's test_accumulate_grad_polyfill_case_1_1 through a user's compiler_fn).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..nodes import FAMILIES
from ..replay.differentiable import Vjp, engine_vjp


def split_joint(graph: fx.GraphModule, example_inputs: list, differentiable: tuple):
    """(forward graph: inputs -> results + saved intermediates, vjp graph:
    saved + cotangents of the differentiable results -> grads of the inputs that
    require grad, number saved), or None when the graph cannot be split."""
    need = [isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs]
    wrt = [i for i, n in enumerate(need) if n]
    if not wrt:
        return None
    mode = next(t.fake_mode for t in example_inputs if hasattr(t, "fake_mode"))

    def joint(primals, tangents):
        # each input its own leaf: fakes keep the real tensors' view relations (a saved
        # `x.t()` is a view of `x`), and the vjp must not send one input's gradient
        # through another, since the engine does that itself with each input's grad_fn
        ps = [p.detach().requires_grad_(True) if n else p for p, n in zip(primals, need)]
        with torch.enable_grad():
            outs = graph(*ps)
        pairs = [(o, t) for o, t in zip([o for o, d in zip(outs, differentiable) if d], tangents) if o.requires_grad]
        if len(pairs) != sum(differentiable):
            raise _NotSplit("a result's requires_grad differs from the trace")
        grads = engine_vjp([o for o, _ in pairs], [t for _, t in pairs], [ps[i] for i in wrt], False)
        return list(outs), list(grads)

    metas = [(tuple(o.shape), tuple(o.stride()), o.dtype, o.device) for o, d in zip(_fake_outputs(graph), differentiable) if d]
    with mode:
        tangents = [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype, device in metas]
    try:
        with torch.no_grad(), mode:
            # (NOTE [A detach stays a gradient cut] in capture/trace.py)
            gm = make_fx(joint, tracing_mode="real", _allow_non_fake_inputs=False, decomposition_table={})(list(example_inputs), tangents)
    except _NotSplit:
        return None
    split = _split(gm, len(differentiable))
    if split is None:
        return None
    fw, bw, n_saved = split
    return fw, Vjp(bw, tuple(metas), graph, tuple(wrt)), n_saved


class _NotSplit(Exception):
    pass


def _fake_outputs(graph: fx.GraphModule):
    out = next(n for n in graph.graph.nodes if n.op == "output")
    return [a.meta["val"] for a in out.args[0]]


def _aliases(n: fx.Node) -> bool:
    """Whether n's (first) result is a view of, or the same tensor as, an argument."""
    if not isinstance(n.target, torch._ops.OpOverload):
        return n.op == "call_function"  # getitem and the like: treat as aliasing
    returns = n.target._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def _base(n):
    """The node whose fresh result `n` is, through views and in-place results."""
    while isinstance(n, fx.Node) and n.op == "call_function" and _aliases(n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _written(n: fx.Node) -> list:
    """The arguments an op writes to."""
    out = []
    for i, arg in enumerate(n.target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
            if isinstance(v, fx.Node):
                out.append(v)
            elif v is not None:
                out.append(None)  # a list of tensors: not followed
    return out


def _constants(nodes: list, backward: set) -> set:
    """The nodes no input of the joint reaches: its get_attr constants, factories and what is
    computed from them alone (sgn's backward makes an _efficientzerotensor, and the ZeroTensor
    kernels of ops on it trace copies of their arguments to the meta device). Both graphs
    compute these themselves instead of the vjp graph reading them from the forward's: a
    ZeroTensor or a meta tensor must not become a graph's input (NOTE [Lifted tensors
    without data], native/collect.cpp). Not random ones (computed twice, they would differ), nor
    anything an op writes to."""
    written = set()
    for n in nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            written.update(_base(a) for a in _written(n))
    if None in written:  # (a list written to: not followed)
        return {n for n in nodes if n.op == "get_attr"}
    out: set = set()
    for n in nodes:
        if n.op == "get_attr":
            out.add(n)
        elif n.op != "call_function" or n in backward or not all(a in out for a in n.all_input_nodes):
            continue
        elif n.target is operator.getitem or (
            isinstance(n.target, torch._ops.OpOverload)
            and not n.target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in n.target.tags
        ):
            if _base(n) not in written:
                out.add(n)
    return out


def _split(gm: fx.GraphModule, n_results: int):
    nodes = list(gm.graph.nodes)
    backward: set = set()
    for n in nodes:
        if n.op == "placeholder" and n.name.startswith("tangents"):
            backward.add(n)
        elif n.op == "call_function" and any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    # A mutation orders nodes beyond their data flow, and the split moves every node that
    # does not depend on the cotangents before every node that does. Safe: mutating a
    # temporary made in the same part (double-backward formulas do, e.g. layer norm's) that
    # no node of the other part read before the mutation. Anything else: keep the rerun.
    order = {n: i for i, n in enumerate(nodes)}
    readers: dict = {}
    for n in nodes:
        if n.op == "call_function":
            for a in n.all_input_nodes:
                readers.setdefault(_base(a), []).append(n)
    for n in nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            part = n in backward
            for a in _written(n):
                base = _base(a)
                if base is None or base.op != "call_function" or _aliases(base) or (base in backward) != part:
                    return None
                if any((r in backward) != part for r in readers.get(base, ()) if order[r] < order[n]):
                    return None
    output = nodes[-1]
    flat = list(output.args[0])  # make_fx flattens (results, grads)
    results, grads = flat[:n_results], flat[n_results:]
    if any(r in backward for r in results if isinstance(r, fx.Node)):
        return None
    consts = _constants(nodes, backward)  # each graph computes them itself
    saved = []
    for n in nodes:
        if n in backward or n in consts or n.op == "output":
            continue
        if any(u in backward for u in n.users):
            saved.append(n)
    for g in grads:  # a grad computed without the cotangents (an input)
        if isinstance(g, fx.Node) and g not in backward and g not in consts and g not in saved:
            saved.append(g)

    def build(keep, inputs, outputs):
        g = fx.Graph()
        env = {}
        for n in inputs:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
        for n in nodes:
            if n in keep and n not in env:
                env[n] = g.node_copy(n, lambda a: env[a])
        g.output([None if o is None else env[o] for o in outputs])
        g.eliminate_dead_code()
        return fx.GraphModule(gm, g)

    primals = [n for n in nodes if n.op == "placeholder" and n.name.startswith("primals")]
    tangents = [n for n in nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    fwd_nodes = {n for n in nodes if n not in backward and n.op == "call_function"} | consts
    fw = build(fwd_nodes, primals, list(results) + saved)
    bw = build((backward - set(tangents)) | consts, saved + tangents, list(grads))
    return fw, bw, len(saved)


def leaf_hooks_only(n) -> bool:
    """Whether node row `n` is an AccumulateGrad that the backward runs whose hooks are its leaf's
    tensor hooks and post-accumulate-grad hooks only (NOTE [A leaf's hooks under create_graph])."""
    on = n.hooks
    return FAMILIES[n.kind].leaf and n.execute and not (on.retains or on.pre or on.post)


def late_leaf_hooks(nodes, create_graph: bool, user_backend: bool) -> bool:
    """Whether the leaves' hooks run as their grads are applied, after the graph (NOTE [A leaf's
    hooks under create_graph]): under create_graph, where every hook is a leaf's own; for a user's
    backend, where those leaves also come after every other node the backward runs."""
    hooked = [i for i, n in enumerate(nodes) if n.hooks.any]
    if not all(leaf_hooks_only(nodes[i]) for i in hooked) or not (create_graph or user_backend):
        return False
    last = max((i for i, n in enumerate(nodes) if n.execute and not FAMILIES[n.kind].leaf), default=-1)
    return create_graph or all(i > last for i in hooked)


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
