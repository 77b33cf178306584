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
  * its backward, the second-order pass: rerun the traced FX graph (aten ops,
    as eager ran them) with grad enabled, and differentiate that with eager's
    engine. A second backward under `enable()` traces that into its own graph,
    so it is compiled as well. Under create_graph again, the rerun uses the
    real inputs themselves, so third and higher orders work as in eager.
  * AccumulateGrad applies the results in grad mode: it clones into `.grad`
    and adds out of place, as eager does under create_graph.

What it does not take (falls back, with its reason): hooks, opaque nodes and
saved-tensor hooks (their calls would run again, or return tensors without
their autograd history), and dynamic shapes (each new size is a static graph).
"""

from __future__ import annotations

import torch


class DifferentiableGraph(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry, extra, *inputs):
        ctx.graph = entry.graph
        ctx.extra = tuple(extra)
        ctx.differentiable = entry.plan.differentiable
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)  # an output nothing differentiates is left out
        outs = list(entry(list(inputs) + list(extra)))
        seen = {id(t) for t in inputs}
        for i, o in enumerate(outs):
            # each output its own tensor: one that is an input, or returned twice, is viewed
            if id(o) in seen:
                outs[i] = o = o.view_as(o)
            seen.add(id(o))
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, ctx.differentiable) if not d])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *cts):
        inputs = ctx.saved_tensors
        need = ctx.needs_input_grad[2:]
        create = torch.is_grad_enabled()
        if create:
            # a higher order: rerun on the inputs themselves, connected to their history
            prims = list(inputs)
        else:
            prims = [t.detach().requires_grad_(True) if n else t for t, n in zip(inputs, need)]
        with torch.enable_grad():
            outs = ctx.graph(*prims, *ctx.extra)
        pairs = [(o, c) for o, c, d in zip(outs, cts, ctx.differentiable) if d and o.requires_grad and c is not None]
        wrt = [i for i, n in enumerate(need) if n]
        grads = [None] * len(inputs)
        if pairs and wrt:
            # eager's engine itself (not torch.autograd's routed global): this
            # may run while a backward that contains this node is traced
            got = torch.autograd.graph._engine_run_backward(
                tuple(o for o, _ in pairs),
                tuple(c for _, c in pairs),
                create,  # keep_graph
                create,
                tuple(prims[i] for i in wrt),
                True,  # allow_unreachable
                False,  # accumulate_grad
            )
            for i, g in zip(wrt, got):
                grads[i] = g
        return (None, None, *grads)
