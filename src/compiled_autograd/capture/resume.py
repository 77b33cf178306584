"""A graph's first run, which can stop at a call and go on in eager's order.

NOTE [A call output in another layout on a graph's first run]
The trace decides the layout of what each call returns before anything runs (NOTE [Layouts
of call outputs], calls/kernel.py): a hook's result is traced in its grad's layout. A hook
that returns another (`g.t().contiguous().t()`) had its result copied into the traced layout;
the values are the same, but a kernel after it may sum in another order than eager's on the
tensor eager passed on (a bias grad `g.sum(0)`: 1e-6 off). The layout seen is learned and the
graph captured again, but the backward in which it came was not eager's.

So a graph's first run (the one right after its capture, where a prediction meets the real
hooks for the first time) runs the traced graph node by node (`first_run`: the same aten ops
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

import functools
import operator

import torch
import torch.fx as fx

from ..errors import ResumeHere
from ..calls import kernel
from ..nodes import SLOT_KINDS
from ..nodes.grads import Value
from ..nodes.hooks import POST_HOOKS
from ..nodes.opaque import NODE
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


# -- at the first run -----------------------------------------------------------------------


def first_run(entry, collected):
    """The graph's first run (NOTE above): a function of the graph's arguments that returns its
    results, stopping at a call whose output comes in another layout and going on from there."""
    gm, plan = entry.graph, entry.plan
    nodes = list(gm.graph.nodes)
    at = {n.name: i for i, n in enumerate(nodes)}
    calls = {n.args[0]: i for i, n in enumerate(nodes) if n.op == "call_function" and n.target is torch.ops.compiled_autograd.call.default}
    # each value is dropped after its last use, or after the last call that may resume from it
    last = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a.name] = i
    for p in plan.resume:
        names = [name for *_, name, bits in p.frontier] + [f for *_, bits in p.frontier if bits for f, _ in bits] + [n for _, n in p.results]
        for name in names:
            last[name] = max(last.get(name, -1), calls[p.slot])
    drop = {}
    for name, i in last.items():
        drop.setdefault(i, []).append(name)
    points = {p.slot: p for p in plan.resume}
    sizes = entry.dynamic.size_inputs if entry.dynamic is not None else ()

    def run(args):
        env = {}
        inputs = iter(args)
        for i, n in enumerate(nodes):
            if n.op == "placeholder":
                env[n.name] = next(inputs)
            elif n.op == "get_attr":
                env[n.name] = operator.attrgetter(n.target)(gm)
            elif n.op == "call_function":
                a, kw = fx.map_arg((n.args, n.kwargs), lambda x: env[x.name])
                try:
                    env[n.name] = n.target(*a, **kw)
                except ResumeHere as stop:
                    run.resumed = True
                    return _resume(collected, plan, points[stop.slot], stop, env, args, sizes)
            elif n.op == "output":
                return [None if x is None else env[x.name] for x in n.args[0]]
            else:  # (our graphs have none)
                raise AssertionError(f"compiled_autograd: a {n.op} node in a traced graph")
            for name in drop.get(i, ()):
                env.pop(name, None)
        raise AssertionError("compiled_autograd: a traced graph without output")

    run.resumable = frozenset(points)
    run.resumed = False
    return run


def _resume(collected, plan, point: ResumePoint, stop: ResumeHere, env: dict, args, sizes) -> list:
    """The rest of the backward from `point`'s call, on the real tensors, as eager runs it;
    the graph's results, laid out as the graph lays them out."""
    from ..observe.stats import LOCK, STATS

    results = [None] * plan.num_results
    for i, name in point.results:
        results[i] = env[name]
    buffers: dict = {}
    for to, nr, name, bits in point.frontier:
        if bits is not None and not any(bool(env[f][pos]) for f, pos in bits):
            continue  # (undefined at run time: nothing waits there)
        buffers.setdefault(to, [None] * collected.nodes[to].num_inputs)[nr] = Value(env[name])
    env.clear()
    resumer = _resumer_class()(collected, plan, results, point.n_result_calls, sizes)
    resumer.go_on(list(args), point, buffers, stop)
    with LOCK:
        STATS.layout_resumes += 1
    return results


@functools.lru_cache(maxsize=None)
def _resumer_class():
    """The Resumer (below), made on first use: it subclasses the tracer, which imports this."""
    from .trace import _BackwardTracer

    class Resumer(_BackwardTracer):
        """The trace's engine loop, run for real from a call on (NOTE above): calls run as they
        come and hand back what they returned; results land where the graph's did."""

        def __init__(self, collected, plan, results, n_calls, sizes):
            super().__init__(collected, {i: why for i, _, why in plan.opaque}, sizes)
            self.resumable = False
            self.graph_results = results
            self.calls_left = iter(plan.result_calls[n_calls:])
            self.steal = kernel.input_storages(collected.lifted)

        def go_on(self, args, point, buffers, stop):
            self.run(args, lambda: self._go_on(args, point, buffers, stop))

        def _go_on(self, args, point, buffers, stop):
            self.buffers = buffers
            captured = [(-1, -1)] * self.capture.num_results()
            if point.kind in (NODE, POST_HOOKS):  # the node's outputs, as they came
                values = list(stop.outs)
                self.resumed_inputs = [None if a is None else Value(a) for a in stop.args] if point.kind == NODE else []
            else:  # the grads entering the node, as the hooks returned them
                values = [None if o is None else Value(o) for o in stop.outs]
            kernel.check_hooks_added(self.capture, point.kind, point.node)
            self._step(point.node, values, args, captured, done=point.kind)
            for idx in range(point.node + 1, len(self.nodes)):
                self._step(idx, self.buffers.pop(idx, [None] * self.nodes[idx].num_inputs), args, captured)

        def _step(self, idx, values, args, captured, done=None):
            # each node in the backward's own grad mode, as the engine runs it: a hook that left
            # it changed (`torch.set_grad_enabled(True)` as a statement) changed it for its node
            # only (the node resumed in: the rest of it too)
            if done is None and torch.is_grad_enabled() != self.capture.grad_mode:
                torch._C._set_grad_enabled(self.capture.grad_mode)
            super()._step(idx, values, args, captured, done)

        def _new_result(self, v):
            r, f = next(self.calls_left)
            if r < 0:
                if v is not None:
                    raise RuntimeError("compiled_autograd: a resumed backward made a gradient where its trace had None")
                return r, f
            if v is None and f < 0:
                raise RuntimeError("compiled_autograd: a resumed backward lost a gradient its trace had")
            self.graph_results[r] = v.t if v is not None else torch.empty(0)
            if f >= 0:
                self.graph_results[f] = torch.tensor(v is not None)
            return r, f

        def _call(self, kind, node, args, out_metas, flags=False, values=None, keeps=None, outs_like_args=False, by_reference_outs=()):
            capture = self.capture  # (real tensors: a subclass, or a value held by reference, goes to its call as it is)
            mask = [m is not None for m in out_metas]
            row = SLOT_KINDS[kind]
            if not row.resumable and not row.accumulates:  # (UNPACK: a graph with one is not resumed)
                raise AssertionError(f"compiled_autograd: a {kind} call in a resumed backward")
            outs = row.run(capture, node, list(args), mask, None, None, self.steal)
            kernel.check_hooks_added(capture, kind, node)
            outs = list(outs) + [None] * (len(mask) - len(outs))
            return [o if m else None for o, m in zip(outs, mask)], None

    return Resumer
