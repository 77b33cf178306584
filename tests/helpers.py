"""Shared test helpers: parity with eager through one cache entry."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

import compiled_autograd as ca


def grads_of(leaves):
    return [None if t.grad is None else t.grad.clone() for t in leaves]


EXACT_BACKENDS = ("eager", "aot_eager")  # eager's kernels in eager's order: bitwise equal


def tolerance(backend) -> dict:
    """How a backend's grads compare with eager's: bitwise where it runs eager's kernels in
    eager's order, else with inductor's tolerance for its fused kernels' rounding."""
    return {"exact": True} if backend in EXACT_BACKENDS else {"rtol": 1e-4, "atol": 1e-5}


def assert_grads_equal(got, want, rtol=None, atol=None, what="", exact=False):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what} grad {i}: expected None, got a tensor"
            continue
        assert g is not None, f"{what} grad {i}: expected a tensor, got None"
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} grad {i}: {g.shape}/{g.dtype} vs {w.shape}/{w.dtype}"
        if exact:
            # (NaN-aware: NaN where eager has NaN; infinities are kept, not mapped to finite values)
            inf = float("inf")
            same = torch.equal(g, w) or (
                g.is_floating_point()
                and torch.equal(g.isnan(), w.isnan())
                and torch.equal(g.nan_to_num(0.0, posinf=inf, neginf=-inf), w.nan_to_num(0.0, posinf=inf, neginf=-inf))
            )
            assert same, f"{what} grad {i}: not bitwise equal to eager (max diff {(g.double() - w.double()).abs().max().item() if g.numel() else 0})"
        else:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{what} grad {i}: {m}")


def parity(
    loss_fn: Callable[..., torch.Tensor],
    leaves: Sequence[torch.Tensor],
    make_inputs: Callable[[int], tuple],
    backend="eager",
    steps: int = 2,
    captures: int = 1,
    rtol=None,
    atol=None,
    check_strides: bool = True,
    **enable_kwargs,
):
    """Run `steps` backwards with different inputs, eager then compiled, compare
    every leaf's grad, and check that only the first compiled one captured."""
    leaves = list(leaves)
    start = ca.stats()
    for step in range(steps):
        inputs = make_inputs(step)
        for t in leaves:
            t.grad = None
        torch.manual_seed(step)
        loss_fn(*inputs).backward()
        want = grads_of(leaves)
        for t in leaves:
            t.grad = None
        torch.manual_seed(step)
        loss = loss_fn(*inputs)
        with ca.enable(backend, fullgraph=True, **enable_kwargs):
            loss.backward()
        got = grads_of(leaves)
        exact = backend in EXACT_BACKENDS and rtol is None and atol is None
        assert_grads_equal(got, want, rtol, atol, what=f"step {step}", exact=exact)
        if check_strides:
            for i, (t, w) in enumerate(zip(leaves, want)):
                if w is not None:
                    assert t.grad.stride() == w.stride(), f"step {step} grad {i}: stride {t.grad.stride()} vs {w.stride()}"
    end = ca.stats()
    assert end.eager_fallbacks == start.eager_fallbacks, end.fallback_reasons
    assert end.captures - start.captures == captures, f"captures: {end}"
    assert end.hits - start.hits == steps - captures, f"hits: {end}"


def copies_in(fn) -> int:
    """The aten::copy_ calls of non-scalar tensors `fn` makes (AccumulateGrad's copy of a
    grad it cannot steal, a copy of what a hook returned; a scalar is the engine task our
    hooks run in)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "aten::copy_" and e.input_shapes and e.input_shapes[0])


def run_in_threads(target, args_per_thread) -> None:
    """Start one thread per argument tuple, all at once, and wait for every one."""
    import threading

    threads = [threading.Thread(target=target, args=args) for args in args_per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
