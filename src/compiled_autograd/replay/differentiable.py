"""A compiled backward that is itself differentiable (create_graph=True): the autograd
Function a create_graph graph runs in, and the vjp graph its backward runs (NOTE
[create_graph] in capture/create_graph.py)."""

from __future__ import annotations

import torch
import torch.fx as fx

from .validate import backend_output_error, mismatches


def engine_vjp(outs, cts, wrt, create: bool):
    """Eager's engine itself (not torch.autograd's routed global): this may run
    while a backward that contains it is traced."""
    return torch.autograd.graph._engine_run_backward(
        tuple(outs),
        tuple(cts),
        create,
        create,
        tuple(wrt),
        True,
        False,  # keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad
    )


class Vjp(torch.nn.Module):
    """The vjp graph of a split create_graph graph, and the layout its cotangents were
    traced with. (A module: a ctx attribute keyed by identity when a backward through
    it is captured.)"""

    def __init__(self, graph: fx.GraphModule, cotangents: tuple, rerun: fx.GraphModule, wrt: tuple):
        super().__init__()
        self.wrt = wrt  # the inputs whose grads it returns (those that require grad: in the key)
        self.graph = graph
        self.cotangents = cotangents  # (shape, stride, dtype, device) per differentiable result
        self.rerun = rerun  # the graph before the split: results only (what a higher order reruns)

    def forward(self, saved, cts):
        args = list(saved)
        for c, (shape, stride, dtype, device) in zip(cts, self.cotangents):
            if c is None:
                c = torch.zeros(shape, dtype=dtype, device=device)
            if c.stride() != stride:  # the graph's views assume the traced layout
                c = torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(c)
            args.append(c)
        return self.graph(*args)


class DifferentiableGraph(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry, extra, *inputs):
        n = entry.plan.num_results
        res = list(entry(list(inputs) + list(extra)))
        if not entry.checked and entry.expected is not None:
            # NOTE [A compiled graph's outputs are checked on its first run] (replay/validate.py): here,
            # where the graph's outputs include what its vjp reads (a static graph: no sizes)
            problems = mismatches(entry.expected, res, ())
            if problems:
                raise backend_output_error(entry, problems)
        outs, saved = res[:n], res[n:]
        ctx.graph = entry.graph if entry.vjp is None else entry.vjp.rerun
        ctx.vjp = entry.vjp
        ctx.extra = tuple(extra)
        ctx.n_inputs = len(inputs)
        ctx.differentiable = entry.plan.differentiable
        ctx.set_materialize_grads(False)  # an output nothing differentiates is left out
        seen = {id(t) for t in inputs}
        for i, o in enumerate(outs):
            # each output its own tensor: one that is an input, or returned twice, is viewed
            if id(o) in seen:
                outs[i] = o = o.view_as(o)
            seen.add(id(o))
        ctx.save_for_backward(*inputs, *saved)
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, ctx.differentiable) if not d])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *cts):
        everything = ctx.saved_tensors
        inputs, saved = everything[: ctx.n_inputs], everything[ctx.n_inputs :]
        need = ctx.needs_input_grad[2:]
        wrt = [i for i, n in enumerate(need) if n]
        grads = [None] * len(inputs)
        diff_cts = [c for c, d in zip(cts, ctx.differentiable) if d]
        if not wrt or all(c is None for c in diff_cts):
            return (None, None, *grads)
        create = torch.is_grad_enabled()
        if ctx.vjp is not None and not create and tuple(wrt) == ctx.vjp.wrt:
            got = ctx.vjp(saved, diff_cts)
        else:
            # rerun the graph in grad mode and differentiate it; under create_graph on the
            # inputs, connected to their history, so that higher orders work
            # (clones, not the inputs themselves: one input may be a view of another, and the
            # vjp must not send one's gradient into the other, the engine does that after us)
            prims = [(t.clone() if create else t.detach().requires_grad_(True)) if n else t for t, n in zip(inputs, need)]
            with torch.enable_grad():
                outs = ctx.graph(*prims, *ctx.extra)[: len(cts)]
            pairs = [(o, c) for o, c, d in zip(outs, cts, ctx.differentiable) if d and c is not None and o.requires_grad]
            if not pairs:
                return (None, None, *grads)
            got = engine_vjp([o for o, _ in pairs], [c for _, c in pairs], [prims[i] for i in wrt], create)
        for i, g in zip(wrt, got):
            grads[i] = g
        return (None, None, *grads)
