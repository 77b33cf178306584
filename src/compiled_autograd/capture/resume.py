"""A graph's first run, which can stop at a call and go on in eager's order.

NOTE [A call output in another layout on a graph's first run]
The trace decides the layout of what each call returns before anything runs (NOTE [Layouts
of call outputs], calls/kernel.py): a hook's result is traced in its grad's layout. A hook
that returns another (`g.t().contiguous().t()`) had its result copied into the traced layout;
the values are the same, but a kernel after it may sum in another order than eager's on the
tensor eager passed on (a bias grad `g.sum(0)`: 1e-6 off). The layout seen is learned and the
graph captured again, but the backward in which it came was not eager's.

So a graph's first run (the one right after its capture, where a prediction meets the real
hooks for the first time) runs the traced graph node by node (capture/first_run.py: the same aten ops
its generated code runs), and a call whose output comes in another layout than traced stops it
there (ResumeHere, raised before the copy). The rest of the backward then goes on from that
call as eager's engine would: the trace's own loop (`_step`) runs the remaining nodes on the
real tensors -- each formula for real, each hook called as it comes, on the output exactly as
the hook returned it -- starting from what the trace held when it made that call, which the
trace wrote down for each such call (ResumePoint: the grads waiting for later nodes and the
results made so far, by the names of the graph nodes holding them; the run keeps those nodes
alive until the call). The results are laid out as the graph's (Plan.result_calls: each result
the trace made, in order), and applied as usual; the layout seen is learned, and the next
backward captures again in it (`stats().layout_resumes`). Nothing of the backward runs twice:
the calls before it ran once, in the graph; it and those after, once, in the resumed steps.

What the first run does not stop at (a copy, as before, counted in `stats().layout_copies`): an
unpack hook's output (learned in an eager backward first), a graph with custom Functions run
as torch.compile'd regions, saved-tensor hooks unpacked in the graph, or create_graph; a call
whose waiting grads the trace could not name. A hit never stops: a hook whose output layout
changes after its graph's first run is copied in that backward, then captured again.
"""

from __future__ import annotations


import torch
import torch.fx as fx

from ..nodes import SLOT_KINDS
from ..values import ResumePoint

KINDS = frozenset(k for k, row in SLOT_KINDS.items() if row.resumable)  # calls whose outputs the graph computes on


def resumable(collected) -> bool:
    """Whether the steps of this backward can be run again on real tensors from a call (above)."""
    if collected.in_graph or collected.unpacked or collected.n_aot:
        return False
    return not any(info.flags[2] for info in collected.pynodes.values())  # (torch.compile'd regions)


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
    return slot, tracer.at, kind, tuple(frontier), len(tracer.result_calls)


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
    for slot, at, kind, frontier, n_calls in tracer.resume_points:
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
            if all(before(out[i]) for i in made):
                kept.append(ResumePoint(slot, at, kind, tuple(named), n_calls, tuple((i, out[i].name) for i in made)))
    return tuple(kept)
