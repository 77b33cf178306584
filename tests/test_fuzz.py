"""Differential testing: random autograd programs (fuzz_programs.py), compiled vs eager.

Each program runs four backwards: two with new values at one batch size (the second a cache
hit), one at another batch size (a new or dynamic capture) and one at a third (a dynamic
graph's hit, or another capture), in one of 8 modes (backward, grad, retain_graph,
create_graph, backward(inputs=), two roots with given grads, grad w.r.t. intermediates, a
backward inside a CPU autocast region); one program in 13 is in float64.
Every leaf's grad (values and strides) and every retained grad is compared with eager's;
where eager raises, the same error. CI runs 40 programs on eager, 10 on aot_eager and 3 on
inductor, and 12 in three threads at once; `FUZZ_PROGRAMS=N` (from seed `FUZZ_FIRST`, default 0) runs more,
`FUZZ_BACKEND=aot_eager|inductor` with another backend, `FUZZ_BACKGROUND=1` with background
compiles (the traced graph replayed until the compiled one takes over). The fast subset
(`-m "not slow and not inductor"`) runs the first 3 programs on eager and the first on
aot_eager, a smoke test (the rest are marked slow: ~2-15 s each on 2 CPU cores).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import compiled_autograd as ca
from fuzz_programs import build
from helpers import EXACT_BACKENDS, INDUCTOR, assert_grads_equal, compare, higher_order_tol, parity, run_in_threads

N = int(os.environ.get("FUZZ_PROGRAMS", "40"))
FIRST = int(os.environ.get("FUZZ_FIRST", "0"))  # the first seed
BACKEND = os.environ.get("FUZZ_BACKEND", "eager")
BACKGROUND = os.environ.get("FUZZ_BACKGROUND") == "1"  # compile in the background, replaying meanwhile


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # (the programs' torch.compile'd regions are shared: without a reset, dynamo's recompile
    # limit is reached after a few programs' shapes, dtypes and autocast states)
    torch._dynamo.reset()
    yield


def _grads(leaves, retained):
    return [None if t.grad is None else t.grad.clone() for t in list(leaves) + list(retained)]


MODES = ("backward", "grad", "retain_graph", "create_graph", "inputs", "roots", "grad_nonleaf", "backward_autocast")


def _run(mode, leaves, loss_fn, retained):
    """What the mode computes: the tensors compared with eager's."""
    loss = loss_fn()
    if mode == "grad":
        wanted = [t for t in leaves[:2] if t.requires_grad]
        return list(torch.autograd.grad(loss, wanted, allow_unused=True))
    if mode == "grad_nonleaf":  # w.r.t. intermediates too, with a grad for the root
        wanted = [leaves[0]] + [t for t in retained]
        return list(torch.autograd.grad(loss, wanted, torch.tensor(-2.0), allow_unused=True))
    if mode == "retain_graph":
        loss.backward(retain_graph=True)
        loss.backward()
    elif mode == "create_graph":
        (g,) = torch.autograd.grad(loss, leaves[0], create_graph=True)
        (g.pow(2).sum() + loss).backward()
    elif mode == "inputs":  # backward(inputs=): only these accumulate
        loss.backward(inputs=[leaves[0], leaves[2]])
    elif mode == "backward_autocast":  # the formulas run autocast too (keyed: a graph of its own)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss.backward()
    elif mode == "roots":  # two roots, one of them not a scalar, with given grads
        other = (leaves[0] * leaves[0]).sum(1)
        torch.autograd.backward([loss, other], [torch.tensor(0.5), torch.linspace(-1, 1, other.shape[0])])
    else:
        loss.backward()
    return _grads(leaves, retained)


def _outcome(mode, leaves, loss_fn, retained):
    """Eager's error (e.g. a once_differentiable node under create_graph), by its type and
    first line, or the grads."""
    try:
        return None, _run(mode, leaves, loss_fn, retained)
    except RuntimeError as e:
        return (type(e), str(e).splitlines()[0]), None


def _dtype(seed: int):
    return torch.float64 if seed % 13 == 7 else torch.float32


def _tolerance(want, backend, autocast):
    # where not bitwise: a compiler may round bfloat16 intermediates differently under autocast
    # -- inductor keeps fused ones in float32 -- and inductor reorders float32 sums: their
    # error scales with the largest value summed, not with each result
    scale = max(1.0, want.abs().max().item())
    if autocast:
        return dict(rtol=3e-2, atol=1e-2 * scale, equal_nan=True)
    if backend == "inductor":
        return dict(rtol=1e-4, atol=1e-5 * scale, equal_nan=True)
    return dict(rtol=1e-4, atol=1e-5, equal_nan=True)


def run_program(seed: int, backend: str, mode: str = "backward") -> bool:
    """Whether every step ran without an error (eager's and ours). Each step's error or grads
    (values and strides: bitwise on the exact backends) compared by helpers.compare."""
    programs = []

    def run(step, scope):
        if len(programs) == step:
            batch, values = [(5, 1), (5, 2), (7, 3), (9, 4)][step]
            programs.append(build(seed, batch, values, dtype=_dtype(seed)))
        leaves, loss_fn, retained, init_grads = programs[step]
        init_grads()
        with scope:
            return _outcome(mode, leaves, loss_fn, retained)

    def tol(want):
        autocast = programs[-1][1].autocast or mode == "backward_autocast"  # (this step's program)
        return _tolerance(want, backend, autocast)

    exact = backend in EXACT_BACKENDS and mode != "create_graph"
    if backend in EXACT_BACKENDS and mode == "create_graph":
        tol = higher_order_tol  # the leaves' grads hold a second order: NOTE [The contract of a second-order gradient]
    results = compare(
        run,
        backend,
        4,
        what=f"seed {seed} {mode} step",
        strides=True,
        exact=exact,
        tol=None if exact else tol,
        eager_fallbacks=None,
        fullgraph=mode != "create_graph" and not BACKGROUND,
        background=BACKGROUND,
    )
    return all(want[0] is None for want, _ in results)


def _check_counters(mode):
    s = ca.stats()
    # (a saved-tensor hook with no prediction: the first backwards of a graph run in eager to learn)
    assert s.hits >= 1 or s.eager_fallbacks or s.learning_backwards, s
    if mode != "create_graph":
        assert s.eager_fallbacks == 0, s.fallback_reasons


def _seeds(seeds, fast):
    """The first `fast` programs in the fast subset, the rest marked slow (a program takes ~3 s
    on eager on 2 CPU cores, up to ~15 s compiled)."""
    return [s if i < fast else pytest.param(s, marks=pytest.mark.slow) for i, s in enumerate(seeds)]


@pytest.mark.parametrize("seed", _seeds(range(FIRST, FIRST + N), fast=3))
def test_random_program_matches_eager(seed):
    mode = MODES[seed % len(MODES)]
    if run_program(seed, BACKEND, mode):  # (a backward that raised, as eager's did, counts nothing)
        _check_counters(mode)


@pytest.mark.parametrize("seed", _seeds(range(max(N // 4, 1)), fast=1))
def test_random_program_compiled_by_aot_autograd_matches_eager(seed):
    mode = MODES[seed % len(MODES)]
    if run_program(seed, "aot_eager", mode):
        _check_counters(mode)


@pytest.mark.inductor
@pytest.mark.parametrize("seed", _seeds(range(3), fast=1))
def test_random_program_compiled_by_inductor_matches_eager(seed):
    mode = MODES[seed % len(MODES)]
    if run_program(seed, "inductor", mode):
        _check_counters(mode)


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_a_boolean_mask_index_in_a_grad_formula_compiles(backend):
    # found by the fuzzer (aot_eager, seed 60): `y[mask] = v` with a v that requires grad makes
    # the backward read `grad[mask]`, whose shape depends on the mask's values; AOTAutograd's
    # fake mode for aot_eager had no ShapeEnv to give it an unbacked size and raised
    w = torch.randn(4, 5, requires_grad=True)

    def loss(x):
        y = (x * w).clone()
        y[x > 0] = y[0, 0] * 2
        return y.pow(2).sum()

    parity(loss, [w], lambda s: (torch.randn(4, 5, generator=torch.Generator().manual_seed(s)),), backend=backend, background=False)


@pytest.mark.inductor
def test_a_mutated_buffer_read_after_a_loop_recompute_under_inductor():
    # found by the fuzzer (inductor, seed 20): topk's backward scatters into a copy of zeros,
    # and the add that reads the result was ordered before the scatter once the C++ backend
    # had recomputed its loops (NOTE [Mutation renames after a loop recompute], compile/inductor_patches.py)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(6, 6, generator=g, requires_grad=True)
    c = torch.randn(6, generator=g, requires_grad=True)

    def loss(x):
        h = x @ W + c
        p1 = h.topk(2, dim=1).values.sum(1, keepdim=True) * h
        p2 = h.repeat(1, 2)[:, ::2] * p1
        terms = [h, p1, p2, torch.nn.functional.layer_norm(h, (6,)) * p2, h.repeat(1, 2)[:, ::2] * p2]
        return sum((t * (i + 1)).sum() for i, t in enumerate(terms))

    parity(
        loss,
        [W, c],
        lambda s: (torch.randn(5, 6, generator=torch.Generator().manual_seed(s)),),
        backend="inductor",
        background=False,
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.slow
def test_graphs_get_no_tensor_without_data():
    # found by the fuzzer (inductor, seed 150, create_graph): the backward through a create_graph
    # result lifted a meta tensor and a ZeroTensor (no data: sgn's backward makes one, and the
    # ZeroTensor kernels trace copies to meta) that the create_graph graph returned for its
    # vjp, and inductor's kernel read through a null pointer (a segfault). Such a lifted tensor
    # makes its node opaque (NOTE [Lifted tensors without data]); and the split no longer
    # saves what no input reaches: each graph computes it, so the node here is compiled
    seen = []

    def checking(gm, example_inputs):
        seen.extend(t for t in example_inputs if isinstance(t, torch.Tensor))
        return gm

    assert run_program(150, checking, "create_graph")
    s = ca.stats()
    # four steps in two graphs each (the create_graph backward, the backward through it), at
    # three batch sizes: the second step of the first size is a hit of both
    assert (s.eager_fallbacks, s.opaque_nodes) == (0, 0) and s.hits >= 2 and s.captures >= 2, s
    assert seen
    bad = [(t.device, tuple(t.shape)) for t in seen if t.is_meta or (t.numel() and t.data_ptr() == 0)]
    assert not bad, bad


def _compare_in_a_thread(seeds, batches, turns, failures) -> None:
    """Each program of `seeds` at each batch size, values 1 then 2 (the second a hit): eager's
    grads, then ours on the eager backend, bitwise; the forwards take `turns` (dropout's masks
    come from the global generator, seeded per forward). Failures go to `failures`."""
    try:
        for seed in seeds:
            for batch in batches:
                for values in (1, 2):
                    leaves, loss_fn, _, init_grads = build(seed, batch, values)
                    init_grads()
                    with turns:
                        loss = loss_fn()
                    loss.backward()
                    want = _grads(leaves, [])
                    init_grads()
                    with turns:
                        loss = loss_fn()
                    with ca.enable("eager", background=False):
                        loss.backward()
                    try:
                        assert_grads_equal(_grads(leaves, []), want, what=f"seed {seed} batch {batch} values {values}", exact=True)
                    except AssertionError as e:
                        failures.append(str(e))
    except Exception as e:  # noqa: BLE001 (reported by the test, with the thread's seeds)
        failures.append(f"seeds {seeds}: {e!r}")


FUZZ_SEEDS = [0, 1, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14]


@pytest.mark.slow
def test_random_programs_in_threads_match_eager():
    # three threads, each backward under its own enable() while the others run theirs: the
    # cache, the stats and the capture state are shared. What else moves the global generator
    # under another thread's forward is left out: checkpoint's recompute (eager's own
    # fork_rng; programs 2 and 5) and AOTAutograd's compile (it saves and restores the
    # generator's state around a compile: torch's, under torch.compile in any thread too), so
    # the eager backend
    turns, failures = threading.Lock(), []
    run_in_threads(lambda seeds: _compare_in_a_thread(seeds, (5,), turns, failures), [(FUZZ_SEEDS[k::3],) for k in range(3)])
    assert not failures, failures
    # what each program captures is what it captures alone: no formula failed on its fakes
    # because another thread traced at the same time (NOTE [One capture trace at a time]:
    # before it, 4 to 88 nodes ran opaquely here, and one run in ten had a wrong gradient)
    s = ca.stats()
    assert (s.opaque_nodes, s.eager_fallbacks) == (0, 0), s
    assert s.captures == len(FUZZ_SEEDS) and s.hits == len(FUZZ_SEEDS), s


@pytest.mark.slow
def test_random_programs_beside_torch_compile_in_another_thread():
    # a user's torch.compile in one thread while two others capture: dynamo traces on fake
    # tensors too, which are not thread-safe (NOTE [One capture trace at a time]), and its
    # compiles are serialized with our background compiles but not with our captures. Every
    # backward bitwise eager's, no node made opaque, no fallback. (Dynamo's compile saves and
    # restores the global generator around itself -- torch's, as under eager -- so it takes
    # turns with the forwards, whose dropout draws from that generator; the backwards, and so
    # our captures, run beside it.)
    turns = threading.Lock()
    stop = threading.Event()
    failures, compiled = [], [0]

    def user_compiles():
        i = 0
        while not stop.is_set():
            i += 1  # (a new code object each time: dynamo traces every one)
            src = f"def f(x, y):\n    return ((x @ y).relu() * {i}.0 + x.sin().sum()).softmax(-1).sum() + {i}\n"
            scope: dict = {"torch": torch}
            exec(compile(src, f"<user {i}>", "exec"), scope)
            try:
                with turns:
                    torch.compile(scope["f"], backend="eager", dynamic=False)(torch.randn(8, 8), torch.randn(8, 8))
                compiled[0] += 1
            except Exception as e:  # noqa: BLE001 (reported below)
                failures.append(f"torch.compile: {e!r}")

    user = threading.Thread(target=user_compiles)
    user.start()
    try:
        # (a second batch size: a dynamic capture, traced with make_fx)
        run_in_threads(lambda seeds: _compare_in_a_thread(seeds, (5, 7), turns, failures), [(FUZZ_SEEDS[k::2],) for k in range(2)])
    finally:
        stop.set()
        user.join()
    assert not failures, failures[:5]
    s = ca.stats()
    assert compiled[0] > 10, compiled
    assert s.captures == 2 * len(FUZZ_SEEDS) and s.hits == 2 * len(FUZZ_SEEDS), s
    assert (s.opaque_nodes, s.eager_fallbacks) == (0, 0), s
