"""A graph's first run, which can stop at a call and go on in eager's order.

NOTE [A call output not as traced]
The trace decides what each call returns before anything runs: a plain tensor (NOTE [Layouts of
call outputs], calls/kernel.py), of the grad's dtype and shape, in the layout it will likely
have. A hook, an opaque node or a node's pre/post hook may return something else at run time:

  * another layout (`g.t().contiguous().t()`): copied into the traced one, the values are the
    same, but a kernel after it may sum in another order than eager's on the tensor eager
    passed on (a bias grad `g.sum(0)`: 1e-6 off);
  * a tensor subclass (a TwoTensor, a DTensor, a user's wrapper) or a `__torch_function__`
    subclass where the graph has a plain tensor: eager runs the nodes after it through the
    subclass's dispatch (and `.grad` becomes one); the compiled graph would read it as a plain
    tensor -- under inductor a wrapper without storage -- a silent wrong gradient.

Either stops the graph at that call, and the rest of the backward goes on from it as eager's
engine would: the trace's own loop (`_step`, capture/first_run.py Resumer) runs the remaining
nodes on the real tensors -- each formula for real, each hook called as it comes, on the output
exactly as the call returned it -- starting from what the trace held when it made that call.
The trace wrote that down for each such call (ResumePoint: the grads waiting for later nodes and
the results made so far, by the graph values holding them), and the call takes those values as
its last `Slot.n_resume` arguments (`pass_values`), so they reach the kernel whatever the
backend made of the graph: the kernel raises ResumeHere with them, before anything of the output
enters the graph. The results are laid out as the graph's (Plan.result_calls: each result the
trace made, in order), and applied as usual. Nothing of the backward runs twice: the calls
before it ran once, in the graph; it and those after, once, in the resumed steps.

What was seen is learned (NOTE [Layouts of call outputs]): the layout, or, for a subclass, that
the output is held by reference (NOTE [Values passed by reference], nodes/references.py); the
graph is dropped and the next backward captures again with it (`stats().layout_resumes`,
`stats().type_resumes`). The saved tensors the resumed nodes read are the graph's inputs, which
a hit handed to the graph (NOTE [Boxed graphs free their inputs]): the run keeps weak references
to them, and those the resumed nodes read are alive at the call, since the graph reads them
after it (`needed`; a compiler that moved every read of one before the call leaves an error,
never a wrong value).

Where a call has no resume point (a graph that unpacks saved tensors in it, or inlines
torch.compile'd regions, or create_graph; a call whose waiting grads the trace could not name),
an output in another layout is copied (`stats().layout_copies`, learned, captured again) and one
of another type raises: it never enters the graph.
"""

from __future__ import annotations


import torch
import torch.fx as fx

from ..nodes import SLOT_KINDS
from ..nodes.saved_tensors import UNPACK
from ..values import ResumePoint

KINDS = frozenset(k for k, row in SLOT_KINDS.items() if row.resumable)  # calls whose outputs the graph computes on


def resumable(collected) -> bool:
    """Whether the steps of this backward can be run again on real tensors from a call (above)."""
    return True


# -- at capture: what the trace holds at a call ---------------------------------------------


def held(tracer, slot: int, kind: str):
    """The grads waiting for later nodes when the trace makes call `slot`, as graph nodes;
    None where one cannot be named (then the first run copies there, as a hit does)."""
    frontier = []
    for to, values in tracer.buffers.items():
        for nr, v in enumerate(values):
            if v is None:
                continue
            node = _fx_node(v.t)
            bits = None if v.bits is None else tuple((_fx_node(f), pos) for f, pos in v.bits)
            if node is None or (bits is not None and any(b is None for b, _ in bits)):
                return None
            frontier.append((to, nr, node, bits))
    unpacked = ()
    if kind == UNPACK:  # in a node's formula: the grads entering it, what it unpacked before
        for nr, v in enumerate(tracer.node_values or ()):
            node = None if v is None else _fx_node(v.t)
            bits = None if v is None or v.bits is None else tuple((_fx_node(f), pos) for f, pos in v.bits)
            if v is not None and (node is None or (bits is not None and any(b is None for b, _ in bits))):
                return None
            if v is not None:
                frontier.append((tracer.at, nr, node, bits))
        unpacked = tuple((hid, _fx_node(x)) for hid, x in tracer.unpacked_here.items())
        if any(n is None for _, n in unpacked):
            return None
    return slot, tracer.at, kind, tuple(frontier), len(tracer.result_calls), unpacked


def _fx_node(t):
    """The graph node of a tensor the running trace made: the recorder's, or make_fx's proxy."""
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode, get_proxy_slot
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from .record import Recorder

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, Recorder):
            return None if mode.live else mode.node_of.get(id(t))
        if isinstance(mode, ProxyTorchDispatchMode):
            proxy = get_proxy_slot(t, mode.tracer, None)
            return None if proxy is None else proxy.proxy.node
    return None


def points(gm: fx.GraphModule, tracer) -> tuple:
    """The trace's resume points by node names, for those every node of which the finished
    graph still computes before the call (a pass may have moved or removed one)."""
    if not tracer.resume_points:
        return ()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    calls = {n.args[0]: n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.compiled_autograd.call.default}
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    kept = []
    for slot, at, kind, frontier, n_calls, unpacked in tracer.resume_points:
        call = calls.get(slot)
        if call is None:
            continue
        before = lambda n: isinstance(n, fx.Node) and n in order and order[n] < order[call]  # noqa: E731
        named = []
        for to, nr, node, bits in frontier:
            named.append((to, nr, node.name, None if bits is None else tuple((f.name, pos) for f, pos in bits)))
            if not before(node) or (bits is not None and not all(before(f) for f, _ in bits)):
                break
        else:
            made = [i for rf in tracer.result_calls[:n_calls] for i in rf if i >= 0]
            if all(before(out[i]) for i in made) and all(before(n) for _, n in unpacked):
                kept.append(
                    ResumePoint(
                        slot,
                        at,
                        kind,
                        tuple(named),
                        n_calls,
                        tuple((i, out[i].name) for i in made),
                        unpacked=tuple((hid, n.name) for hid, n in unpacked),
                    )
                )
    return tuple(kept)


def pass_values(gm: fx.GraphModule, slots: tuple, kept: tuple) -> tuple:
    """Each resume point's values as its call's last arguments before the passed ones (NOTE [The
    layout of a call's arguments], capture/lint.py): (slots with `n_resume`, points with
    `values`)."""
    if not kept:
        return slots, kept
    from ..calls.protocol import PASSES_SHIFT, CallArgs

    slots = list(slots)
    by_name = {n.name: n for n in gm.graph.nodes}
    calls = {n.args[0]: n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.compiled_autograd.call.default}
    out = []
    for p in kept:
        names = (
            [name for *_, name, bits in p.frontier] + [f for *_, bits in p.frontier if bits for f, _ in bits] + [n for _, n in p.results]
        )
        names += [n for _, n in p.unpacked]
        names = tuple(dict.fromkeys(names))
        call = calls[p.slot]
        c = CallArgs.of(call)
        n_passed = c.flags >> PASSES_SHIFT
        args = list(c.args)
        at = len(args) - n_passed
        call.args = tuple(c._replace(args=args[:at] + [by_name[n] for n in names] + args[at:]))
        slots[p.slot] = slots[p.slot]._replace(n_resume=len(names))
        out.append(p._replace(values=names))
    gm.recompile()
    return tuple(slots), tuple(out)


def needed(gm: fx.GraphModule, slot: int) -> list:
    """The graph's input positions that nodes after call `slot` read (directly or through a view
    of one): what a backward resumed there reads (NOTE [A call output not as traced])."""
    import operator

    from ..calls.protocol import DEFINEDNESS, PASSES_SHIFT, CallArgs
    from .create_graph import _aliases

    call = torch.ops.compiled_autograd.call.default
    nodes = list(gm.graph.nodes)
    at = next(i for i, n in enumerate(nodes) if n.op == "call_function" and n.target is call and n.args[0] == slot)
    order = {n: i for i, n in enumerate(nodes)}

    def same_tensor(m, u) -> list:
        """What stands for `m` after its use `u`: a view of it, or the output of a call that
        passes it on (NOTE [Hooks may change what the graph reads], capture/passes.py)."""
        if u.op == "call_function" and u.target is call:
            c = CallArgs.of(u)
            n_passed = c.flags >> PASSES_SHIFT
            first = c.n_outputs + (1 if c.flags & DEFINEDNESS else 0)
            passed = list(c.args[len(c.args) - n_passed :]) if n_passed else []
            return [g for g in u.users if g.target is operator.getitem and g.args[1] - first in [j for j, a in enumerate(passed) if a is m]]
        return [u] if _aliases(u) else []

    out, position = [], 0
    for n in nodes:
        if n.op != "placeholder":
            continue
        stack, late = [n], False
        while stack and not late:
            m = stack.pop()
            for u in m.users:
                if order[u] > at:
                    late = True
                    break
                stack.extend(same_tensor(m, u))
        if late:
            out.append(position)
        position += 1
    return out
