"""A graph's first run, which can stop at a call and go on in eager's order (NOTE [A call output
in another layout on a graph's first run] in capture/resume.py, which holds what the trace
writes down for it)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..calls import kernel
from ..errors import ResumeHere
from ..nodes import SLOT_KINDS
from ..nodes.grads import Value
from ..nodes.hooks import POST_HOOKS
from ..nodes.opaque import NODE
from ..values import ResumePoint
from .trace import _BackwardTracer


def first_run(entry, collected):
    """The graph's first run (NOTE [A call output in another layout on a graph's first run] in
    resume.py): a function of the graph's arguments that returns its
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
    resumer = Resumer(collected, plan, results, point.n_result_calls, sizes)
    resumer.go_on(list(args), point, buffers, stop)
    with LOCK:
        STATS.layout_resumes += 1
    return results


class Resumer(_BackwardTracer):
    """The trace's engine loop, run for real from a call on (NOTE [A call output in another layout on a graph's first run], resume.py): calls run as they
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

    def _call(self, kind, node, args, out_metas, flags=False, values=None, keeps=None, outs_like_args=False, by_reference_outs=(),
              out_specs=()):
        capture = self.capture  # (real tensors: a subclass, or a value held by reference, goes to its call as it is)
        mask = [m is not None for m in out_metas]
        row = SLOT_KINDS[kind]
        if not row.resumable and not row.accumulates:  # (UNPACK: a graph with one is not resumed)
            raise AssertionError(f"compiled_autograd: a {kind} call in a resumed backward")
        outs = row.run(capture, node, list(args), mask, None, None, self.steal)
        kernel.check_hooks_added(capture, kind, node)
        outs = list(outs) + [None] * (len(mask) - len(outs))
        return [o if m else None for o, m in zip(outs, mask)], None
