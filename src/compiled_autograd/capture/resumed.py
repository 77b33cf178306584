"""The rest of a backward, in eager's order, from a call whose output was not as traced (NOTE
[A call output not as traced] in capture/resume.py, which holds what the trace writes down for
it): the trace's own engine loop run on the real tensors."""

from __future__ import annotations

import dataclasses

import torch

from ..calls import kernel
from ..errors import NeedsOpaque
from ..nodes import SLOT_KINDS
from ..nodes.grads import Value
from ..nodes.hooks import POST_HOOKS
from ..nodes.opaque import NODE
from ..nodes import saved_tensors
from ..nodes.saved_tensors import UNPACK
from .resume import needed
from .trace import _BackwardTracer


def resume_at(entry, collected, stop, args: list) -> list:
    """The graph's results for a run of `entry` that stopped at a call (`stop`, a ResumeHere):
    those the graph made before it, and the rest of the backward run from it as eager's engine
    runs it. `args`: the graph's inputs, None where one was freed (a boxed graph frees each
    after its last use)."""
    from ..observe.stats import LOCK, STATS

    plan = entry.plan
    point = next(p for p in plan.resume if p.slot == stop.slot)
    n = entry.num_inputs
    dead = [i for i in needed(entry.graph, stop.slot) if i < n and args[i] is None]
    if dead:
        raise RuntimeError(
            f"compiled_autograd: a call returned a {stop.why} other than traced, and the backward cannot go on from it in "
            f"eager's order: the compiled graph already freed {len(dead)} saved tensors the nodes after it read (inputs "
            f"{dead[:8]}); its backend moved their last reads before the call (NOTE [A call output not as traced])"
        )
    stand_in = torch.empty(0, device="meta")  # (read by no node after the call: any read of it raises)
    lifted = [stand_in if a is None else a for a in args[:n]]
    collected = dataclasses.replace(collected, lifted=lifted)
    env = dict(zip(point.values, stop.values))
    results = [None] * plan.num_results
    for i, name in point.results:
        results[i] = env[name]
    buffers: dict = {}
    for to, nr, name, bits in point.frontier:
        if bits is not None and not any(bool(env[f][pos]) for f, pos in bits):
            continue  # (undefined at run time: nothing waits there)
        buffers.setdefault(to, [None] * collected.nodes[to].num_inputs)[nr] = Value(env[name])
    env.clear()
    sizes = entry.dynamic.size_inputs if entry.dynamic is not None else ()
    resumer = Resumer(collected, plan, results, point.n_result_calls, sizes)
    resumer.given = {hid: env[name] for hid, name in point.unpacked}
    if point.kind == UNPACK:  # (the saved tensor the call unpacked: its node's formula takes it as it came)
        resumer.given[plan.slots[stop.slot].node] = stop.outs[0]
    resumer.go_on(lifted + list(args[n:]), point, buffers, stop)
    with LOCK:
        if stop.why == "type":
            STATS.type_resumes += 1
        else:
            STATS.layout_resumes += 1
    return results


class Resumer(_BackwardTracer):
    """The trace's engine loop, run for real from a call on (NOTE [A call output not as traced],
    resume.py): calls run as they come and hand back what they returned; results land where the
    graph's did."""

    def __init__(self, collected, plan, results, n_calls, sizes):
        super().__init__(collected, {i: why for i, _, why in plan.opaque}, sizes)
        self.resumable = False
        self.graph_results = results
        self.calls_left = iter(plan.result_calls[n_calls:])
        self.steal = kernel.input_storages(collected.lifted)
        self.given: dict = {}  # hooked saved tensor -> its value, unpacked before the stop

    def go_on(self, args, point, buffers, stop):
        self.run(args, lambda: self._go_on(args, point, buffers, stop))

    def _go_on(self, args, point, buffers, stop):
        self.buffers = buffers
        captured = [(-1, -1)] * self.walk.num_results()
        if point.kind in (NODE, POST_HOOKS):  # the node's outputs, as they came
            values = list(stop.outs)
            self.resumed_inputs = [None if a is None else Value(a) for a in stop.args] if point.kind == NODE else []
        else:  # the grads entering the node, as the hooks returned them
            values = [None if o is None else Value(o) for o in stop.outs]
        if point.kind == UNPACK:  # (in the node's formula, after its hooks: the grads entering it)
            values = self.buffers.pop(point.node, [None] * self.nodes[point.node].num_inputs)
        kernel.check_hooks_added(self.walk, point.kind, point.node)
        self._step(point.node, values, args, captured, done=point.kind)
        for idx in range(point.node + 1, len(self.nodes)):
            self._step(idx, self.buffers.pop(idx, [None] * self.nodes[idx].num_inputs), args, captured)

    def _step(self, idx, values, args, captured, done=None):
        # each node in the backward's own grad mode, as the engine runs it: a hook that left
        # it changed (`torch.set_grad_enabled(True)` as a statement) changed it for its node
        # only (the node resumed in: the rest of it too)
        if done is None and torch.is_grad_enabled() != self.walk.grad_mode:
            torch._C._set_grad_enabled(self.walk.grad_mode)
        super()._step(idx, values, args, captured, done)

    def _apply(self, idx, kind, values, args):
        try:
            return super()._apply(idx, kind, values, args)
        except NeedsOpaque:  # (a formula that cannot run so on these tensors: the node itself, as eager runs it)
            return self._run_node(idx, values, args)

    def _run_node(self, idx, values, args):
        """Node idx run as is, on the real grads; a custom Function's saved tensors given back
        from the graph's inputs where a hit released them before its graph ran."""
        info = self.c.pynodes.get(idx)
        swap = None
        if info is not None:
            from .. import native

            swap = native.load().PyNodeSavedSwap(self.walk.node_object(idx), [args[i] if i >= 0 else None for i in info.saved])
        try:
            outs = self.walk.call_node(idx, [None if v is None else v.t for v in values])
        finally:
            if swap is not None:
                swap.restore()
        return [None if o is None else Value(o) for o in outs]

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

    def _call(
        self, kind, node, args, out_metas, flags=False, values=None, keeps=None, outs_like_args=False, by_reference_outs=(), out_specs=()
    ):
        capture = self.walk  # (real tensors: a subclass, or a value held by reference, goes to its call as it is)
        mask = [m is not None for m in out_metas]
        row = SLOT_KINDS[kind]
        if kind == UNPACK:  # the hook, for real (once: one its node's formula unpacked before is given)
            given = self.given.pop(node, None)
            return [given if given is not None else saved_tensors.unpack_now(self.c.hooks, node)], None
        if not row.resumable and not row.accumulates:
            raise AssertionError(f"compiled_autograd: a {kind} call in a resumed backward")
        outs = row.run(capture, node, list(args), mask, None, None, self.steal)
        kernel.check_hooks_added(capture, kind, node)
        outs = list(outs) + [None] * (len(mask) - len(outs))
        return [o if m else None for o, m in zip(outs, mask)], None
