"""Activation checkpointing: recomputed in the graph when the backward reaches the region (NOTE
[Unpacking in the graph]), with retain_graph, selective checkpointing and dropout, without
the determinism check, reentrant (an opaque node whose inner backward is compiled too)."""

import contextlib

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import compiled_autograd as ca
from helpers import assert_grads_equal, grads_of, leaf, observe


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checkpointed_region_is_recomputed_when_the_backward_reaches_it(backend):
    # NOTE [Unpacking in the graph]: the recompute runs at the region's first node, after
    # the hooks of the nodes before it, as in eager; not when the backward starts
    def build(log, step):
        x, w = leaf(4, 8), leaf(8, 8)

        def block(h):
            log.append("recompute" if torch._C._current_graph_task_id() != -1 else "forward")
            return (h @ w).tanh() @ w

        h = x.sin()
        y = checkpoint.checkpoint(block, h, use_reentrant=False)
        z = checkpoint.checkpoint(block, y, use_reentrant=False)
        y.register_hook(lambda g: log.append("y's grad") or g)
        z.register_hook(lambda g: log.append("z's grad") or g)
        return z.pow(2).sum(), [x, w]

    # the first backward learns the recomputed tensors' layouts in eager (NOTE [Layouts of call outputs])
    runs = observe(build, backend=backend, steps=3, learning=1)
    assert runs[-1][1] == ["forward", "forward", "z's grad", "recompute", "y's grad", "recompute"]
    assert "saved-tensor hooks: 10 tensors unpacked in the graph" in ca.explain()


def test_checkpoint_without_its_determinism_check_is_learned():
    # without the recorded metadata, what the recomputation returns is not known beforehand:
    # the first backward runs in eager and learns it, later ones unpack in the graph
    def build(log, step):
        x, w = leaf(2, 4), leaf(4, 4)
        y = checkpoint.checkpoint(lambda a: (a @ w).relu(), x, use_reentrant=False, determinism_check="none")
        return y.pow(2).sum(), [x, w]

    observe(build, steps=3, learning=1)
    assert "saved-tensor hooks: 3 tensors unpacked in the graph" in ca.explain()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checkpoint_with_retain_graph_recomputes_for_each_backward(backend):
    calls = []

    def block(a, w):
        calls.append(1)
        return (a @ w).tanh() @ w

    x, w = leaf(4, 8), leaf(8, 8)
    for step in range(2):  # one cache entry, two inputs
        with torch.no_grad():
            x.copy_(torch.randn(4, 8))
        grads = []
        for compiled in (False, True):
            x.grad = w.grad = None
            loss = checkpoint.checkpoint(block, x, w, use_reentrant=False).pow(2).sum()
            with ca.enable(backend, fullgraph=True) if compiled else contextlib.nullcontext():
                loss.backward(retain_graph=True)
                loss.backward()
            grads.append(grads_of([x, w]))
        assert_grads_equal(grads[1], grads[0], what=f"step {step}", exact=True)
    assert len(calls) == 2 * 2 * 3  # steps x (eager, compiled) x (forward, two recomputes)
    s = ca.stats()
    # the first backward learns the layouts in eager (retaining the graph), the second captures
    assert (s.learning_backwards, s.captures, s.hits, s.eager_fallbacks) == (1, 1, 2, 0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_selective_checkpoint_with_dropout(backend):
    # selective checkpointing (mm saved, the rest recomputed) and dropout, whose mask the
    # recompute reproduces from the RNG state checkpoint stashed: unpacked in the graph
    import functools

    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.mm.default:
            return checkpoint.CheckpointPolicy.MUST_SAVE
        return checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    def build(log, step):
        x, w = leaf(4, 8), leaf(8, 8)

        def block(a):
            return torch.nn.functional.dropout((a @ w).tanh(), 0.3, training=True) @ w

        selective = functools.partial(checkpoint.create_selective_checkpoint_contexts, policy)
        y = checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=selective)
        z = checkpoint.checkpoint(block, y, use_reentrant=False)
        return z.pow(2).sum(), [x, w]

    observe(build, backend=backend, steps=3, learning=1)
    assert "saved-tensor hooks: 12 tensors unpacked in the graph" in ca.explain()


def test_checkpointed_node_marked_opaque_unpacks_by_itself():
    # an opaque node runs its own apply, which calls the unpack hook: no unpack call for it
    def build(log, step):
        x, w = leaf(2, 4), leaf(4, 4)
        y = checkpoint.checkpoint(lambda a: (a @ w).exp() @ w, x, use_reentrant=False)
        return y.pow(2).sum(), [x, w]

    # the first backward learns the recomputed tensors' layouts in eager, the second the opaque
    # node's output layouts (NOTE [Layouts of call outputs]); then a capture and a hit
    observe(build, n_opaque=1, opaque=("ExpBackward0",), steps=4, learning=2)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputes_during_backward(use_reentrant):
    calls = []

    def block(x, w):
        calls.append(1)
        return (x @ w).relu() @ w.t()

    def build(log, step):
        x, w = leaf(2, 4), leaf(4, 4)
        n0 = len(calls)
        y = checkpoint.checkpoint(block, x, w, use_reentrant=use_reentrant)
        log.append(("forward calls", len(calls) - n0))
        return y.pow(2).sum(), [x, w]

    n_before = len(calls)
    if use_reentrant:
        # the checkpoint node runs opaquely; the backward it starts inside is compiled too.
        # The outer graph's first backward learns its output layouts in eager (the inner one
        # captures), the second captures (the inner one hits), the third hits both
        observe(build, n_opaque=1, steps=3, captures=2, hits=3, learning=1)
    else:
        observe(build, steps=3, learning=1)
        # unpacked in the graph, each when its node runs: x and w (for x @ w), the relu's
        # output (for relu), the relu's output and w.t() (for ... @ w.t())
        assert "saved-tensor hooks: 5 tensors unpacked in the graph" in ca.explain()
    # every backward (eager and compiled, 3 steps) re-ran the block once
    assert len(calls) - n_before == 3 * 2 * 2  # steps x (eager, compiled) x (forward, recompute)
