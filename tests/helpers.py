"""Shared test helpers: the one eager-vs-compiled driver, and what the tests compare with.

The driver family, one core and its shorthands:

    compare(run, backend, steps, captures=, hits=, ...)   the core: `run(step, scope)` once
        in eager (scope: a null context) and once compiled (scope: ca.enable(backend,
        fullgraph=True, **options)) per step; what the two return is compared (bitwise on
        EXACT_BACKENDS, else with the backend's tolerance) and the counters it adds are checked
    parity(loss_fn, leaves, make_inputs, ...)            fixed leaves, new inputs per step:
        their grads and strides; one capture, then hits
    observe(build, ...)                                  a fresh forward per step whose hooks
        write a log: the grads and the log; learning backwards and opaque nodes counted

A test with a genuinely different run (create_graph's double backward, the fuzzer's program
modes) keeps a small runner of its own and hands it to `compare`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Sequence

import pytest
import torch

import compiled_autograd as ca

# a parametrized backend that compiles with inductor, marked so a fast run can leave it out
INDUCTOR = pytest.param("inductor", marks=pytest.mark.inductor, id="inductor")


def leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def grads_of(leaves):
    return [None if t.grad is None else t.grad.clone() for t in leaves]


EXACT_BACKENDS = ("eager", "aot_eager")  # eager's kernels in eager's order: bitwise equal


def tolerance(backend) -> dict:
    """How a backend's grads compare with eager's: bitwise where it runs eager's kernels in
    eager's order, else with inductor's tolerance for its fused kernels' rounding."""
    return {"exact": True} if backend in EXACT_BACKENDS else {"rtol": 1e-4, "atol": 1e-5}


def higher_order_tol(want: torch.Tensor) -> dict:
    """The tolerance of a second- or higher-order gradient: NOTE [The contract of a second-order
    gradient] (tools/conformance/tensors.py): within SECOND_ORDER_EPS machine epsilons of the
    tensor's largest eager magnitude (the first order is bitwise)."""
    from tools.conformance.tensors import SECOND_ORDER_EPS

    finite = want.detach()[torch.isfinite(want.detach())]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return {"rtol": 0.0, "atol": SECOND_ORDER_EPS * torch.finfo(want.dtype).eps * scale, "equal_nan": True}


def _bitwise(g, w) -> bool:
    # (NaN-aware: NaN where eager has NaN; infinities are kept, not mapped to finite values)
    inf = float("inf")
    return torch.equal(g, w) or (
        g.is_floating_point()
        and torch.equal(g.isnan(), w.isnan())
        and torch.equal(g.nan_to_num(0.0, posinf=inf, neginf=-inf), w.nan_to_num(0.0, posinf=inf, neginf=-inf))
    )


def assert_same(got, want, what="", *, exact=False, tol=None, requires_grad=False, strides=False):
    """What a compiled run gave against what eager gave: tensors (bitwise where `exact`, else
    `torch.testing.assert_close` with `tol`: a dict, or a function of eager's tensor giving
    one), None, nested tuples and lists, and any other value by ==. `requires_grad`: tensors
    must agree on it too (create_graph); `strides`: and on their strides."""
    if want is None:
        assert got is None, f"{what}: expected None, got {type(got).__name__}"
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {got!r}"
        if requires_grad:
            assert got.requires_grad == want.requires_grad, f"{what}: requires_grad {got.requires_grad} vs eager {want.requires_grad}"
            got, want = got.detach(), want.detach()
        assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
        if exact:
            diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0
            assert _bitwise(got, want), f"{what}: not bitwise equal to eager (max diff {diff})"
        else:
            kw = tol(want) if callable(tol) else (tol or {})
            torch.testing.assert_close(got, want, **kw, msg=lambda m: f"{what}: {m}")
        if strides:
            assert got.stride() == want.stride(), f"{what}: strides {got.stride()} vs {want.stride()}"
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want), f"{what}: {got!r} vs eager's {want!r}"
        assert len(got) == len(want), f"{what}: {len(got)} values vs eager's {len(want)}:\n{got}\n{want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what} #{i}", exact=exact, tol=tol, requires_grad=requires_grad, strides=strides)
    else:
        assert type(got) is type(want) and got == want, f"{what}: {got!r} vs eager's {want!r}"


def assert_grads_equal(got, want, rtol=None, atol=None, what="", exact=False):
    """Two lists of grads (tensors or None), element by element: bitwise where `exact`."""
    assert len(got) == len(want), f"{what}: {len(got)} grads vs {len(want)}"
    tol = None if rtol is None and atol is None else {"rtol": rtol, "atol": atol}
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"{what} grad {i}", exact=exact, tol=tol)


@contextlib.contextmanager
def counts(*, captures=None, hits=None, learning_backwards=None, opaque_nodes=None, eager_fallbacks=0):
    """What the block adds to ca.stats(), each counter that is not None checked (eager
    fallbacks: none, unless said otherwise)."""
    start = ca.stats()
    yield
    end = ca.stats()
    want = {
        "captures": captures,
        "hits": hits,
        "learning_backwards": learning_backwards,
        "opaque_nodes": opaque_nodes,
        "eager_fallbacks": eager_fallbacks,
    }
    for name, n in want.items():
        if n is not None:
            added = getattr(end, name) - getattr(start, name)
            why = end.fallback_reasons if name == "eager_fallbacks" else end.opaque_details if name == "opaque_nodes" else end
            assert added == n, f"{name}: {added}, expected {n}: {why}"


def compare(
    run: Callable,
    backend="eager",
    steps: int = 2,
    *,
    captures=None,
    hits=None,
    learning_backwards=None,
    opaque_nodes=None,
    eager_fallbacks=0,
    exact=None,
    tol=None,
    requires_grad=False,
    strides=False,
    what="step",
    **options,
) -> list:
    """The driver's core. Per step, `run(step, scope)` in eager (scope: a null context), then
    compiled (scope: ca.enable(backend, fullgraph=True, **options)); each run does its forward
    and its backward under `scope` and returns what to compare (see assert_same): bitwise on
    EXACT_BACKENDS unless a `tol` is given, else with `tol` or the backend's tolerance.
    The counters the steps add are checked as `counts` checks them. Returns, per step,
    (eager's, compiled's)."""
    if exact is None:
        exact = backend in EXACT_BACKENDS and tol is None
    if tol is None and not exact:
        tol = {k: v for k, v in tolerance(backend).items() if k != "exact"}
    options = {"fullgraph": True, **options}
    results = []
    with counts(
        captures=captures, hits=hits, learning_backwards=learning_backwards, opaque_nodes=opaque_nodes, eager_fallbacks=eager_fallbacks
    ):
        for step in range(steps):
            want = run(step, contextlib.nullcontext())
            got = run(step, ca.enable(backend, **options))
            assert_same(got, want, f"{what} {step}", exact=exact, tol=tol, requires_grad=requires_grad, strides=strides)
            results.append((want, got))
    return results


def parity(
    loss_fn: Callable[..., torch.Tensor],
    leaves: Sequence[torch.Tensor],
    make_inputs: Callable[[int], tuple],
    backend="eager",
    steps: int = 2,
    captures=1,
    rtol=None,
    atol=None,
    check_strides: bool = True,
    seed: bool = True,
    **enable_kwargs,
):
    """`steps` backwards of loss_fn(*make_inputs(step)) with different inputs, eager then
    compiled: every leaf's grad (and its strides) compared, and only the first compiled one
    captured (`captures=None`: the counters are the caller's to check). `seed`: each forward
    starts from torch.manual_seed(step) (the same random numbers in both)."""
    leaves = list(leaves)
    inputs = {}

    def run(step, scope):
        if step not in inputs:
            inputs[step] = make_inputs(step)  # once per step: eager and compiled get the same
        for t in leaves:
            t.grad = None
        if seed:
            torch.manual_seed(step)
        loss = loss_fn(*inputs[step])
        with scope:
            loss.backward()
        layout = [None if t.grad is None else t.grad.stride() for t in leaves] if check_strides else None
        return grads_of(leaves), layout

    tol = None if rtol is None and atol is None else {"rtol": rtol, "atol": atol}
    hits = None if captures is None else steps - captures
    return compare(run, backend, steps, captures=captures, hits=hits, tol=tol, **enable_kwargs)


def observe(build, backend="eager", steps=2, captures=1, n_opaque=0, hits=None, learning=0, **options):
    """Per step, a fresh forward `build(log, step)` -> (loss, leaves) whose hooks append what
    they see to `log`, eager then compiled: the same grads and logs. `learning`: backwards run
    in eager to learn what saved-tensor unpack hooks return (NOTE [Unpack metadata learned
    from the last backward]); `n_opaque` per compiled backward. Returns the last step's
    [(grads, log, leaves) of eager, of compiled]."""
    built = []

    def run(step, scope):
        log = []
        torch.manual_seed(step)
        loss, leaves = build(log, step)
        with scope:
            loss.backward()
        built.append((grads_of(leaves), log, leaves))
        return built[-1][:2]

    compare(
        run,
        backend,
        steps,
        captures=captures,
        hits=steps - captures - learning if hits is None else hits,
        learning_backwards=learning,
        opaque_nodes=n_opaque * (steps - learning),
        **options,
    )
    return built[-2:]


def slot_kinds() -> list:
    """The kinds of the calls in every cached graph's plan (nodes/__init__.py SLOT_KINDS)."""
    return [s.kind for e in ca.graphs() for s in e.plan.slots]


def copies_in(fn) -> int:
    """The aten::copy_ calls of non-scalar tensors `fn` makes (AccumulateGrad's copy of a
    grad it cannot steal, a copy of what a hook returned; a scalar is the engine task our
    hooks run in)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "aten::copy_" and e.input_shapes and e.input_shapes[0])


def run_in_threads(target, args_per_thread) -> None:
    """One thread per argument tuple; they wait for each other at a barrier, so that every
    target starts while the others run, and each is waited for."""
    barrier = threading.Barrier(len(args_per_thread), timeout=60)

    def start(*args):
        barrier.wait()
        target(*args)

    threads = [threading.Thread(target=start, args=args) for args in args_per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
