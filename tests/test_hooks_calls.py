"""Hook and node calls on a hit run in the native helper, without Python's call, and
check what it checks (NOTE [Calls in the helper]); its replay frames are per thread.
"""

import contextlib

import pytest
import torch
import torch.nn as nn

import compiled_autograd as ca
from compiled_autograd.calls import kernel
from compiled_autograd.nodes.accumulate import ACCUMULATE, HOOKED_ACCUMULATE
from compiled_autograd.nodes.hooks import TENSOR_PRE_HOOKS
from compiled_autograd.nodes.opaque import NODE
from helpers import EXACT_BACKENDS, INDUCTOR, assert_grads_equal, leaf, observe, run_in_threads, slot_kinds


@contextlib.contextmanager
def _python_calls():
    """The slots of the calls from compiled code that reach Python's call (NOTE [Calls
    in the helper]: only unpack calls and calls off the fast path should)."""
    native = kernel.native_calls()
    calls = []

    def counting(*args):
        calls.append(args[0])
        return kernel.call(*args)

    kernel.install_native(native, counting)
    try:
        yield calls
    finally:
        kernel.install_native(native)


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_leaf_calls_run_in_the_helper_and_check_what_python_checks(backend):
    # NOTE [Calls in the helper]: on a hit, a hooked leaf's call and a leaf's
    # AccumulateGrad call (in the graph for its post-accumulate hook) do not go through
    # Python's call, and still check what it checks: a leaf's hook that changes a saved
    # tensor of a node not yet run gets eager's version-counter error
    def run(compiled, step):
        torch.manual_seed(0)
        W, b, x2 = leaf(4, 4), leaf(4), leaf(4)
        torch.manual_seed(step)
        x, a = torch.randn(3, 4), torch.randn(4)
        late = (x2 * a).sin().sum()  # made first: its MulBackward0 runs after W's accumulation
        early = torch.tanh(x @ W + b).pow(2).sum()
        seen = []

        def hook(g):
            seen.append(g.sum().item())
            if step == 2:
                with torch.no_grad():
                    a.add_(1.0)
            return g * 0.5

        W.register_hook(hook)
        b.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.sum().item()))
        if compiled:
            with ca.enable(backend, fullgraph=True, background=False):
                (early + late).backward()
        else:
            (early + late).backward()
        return [W.grad, b.grad, x2.grad], seen

    with _python_calls() as python_calls:
        for step in range(2):
            (got, got_seen), (want, want_seen) = run(True, step), run(False, step)
            assert_grads_equal(got, want, what=f"step {step}", exact=backend in EXACT_BACKENDS)
            if backend in EXACT_BACKENDS:
                assert got_seen == want_seen, (got_seen, want_seen)
            else:
                assert got_seen == pytest.approx(want_seen, rel=1e-5, abs=1e-6)
    assert python_calls == [], python_calls  # the capture traced them; the hit ran them natively
    for compiled in (False, True):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            run(compiled, 2)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 2, 0), s
    assert sorted(slot_kinds()) == [ACCUMULATE] * 2 + [HOOKED_ACCUMULATE]  # b, x2; W


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_hook_and_node_calls_run_in_the_helper(backend):
    # NOTE [Calls in the helper]: tensor hooks on activations (one keeps what it returns),
    # a module's full backward hook (its pre- and post-hook calls) and an opaque node run
    # without Python's call, and every hook observes what it observes in eager
    kept = []

    def build(log, step):
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        lin.register_full_backward_hook(lambda m, gi, go: log.append(("module", gi[0].clone(), go[0].clone())))
        torch.manual_seed(step)
        x = leaf(3, 4)
        h = lin(x).tanh()
        h.register_hook(lambda g: log.append(("h", g.clone())))
        k = h * 2.0  # MulBackward0: opaque

        def keep(g):
            kept.append(g * 3)
            return kept[-1]

        k.register_hook(keep)
        return k.pow(2).sum(), [x, *lin.parameters()]

    with _python_calls() as python_calls:
        # the first backward learns the opaque node's output layouts in eager (NOTE [Layouts
        # of call outputs]); then a capture and a hit
        observe(build, backend=backend, background=False, opaque=("MulBackward0",), n_opaque=1, steps=3, learning=1)
    assert python_calls == [], python_calls
    assert {TENSOR_PRE_HOOKS, NODE} <= set(slot_kinds()), slot_kinds()
    # what `keep` returned and kept: the compiled graph read it and wrote nothing into it
    assert_grads_equal([kept[-1]], [kept[-2]], exact=backend in EXACT_BACKENDS)


def test_hooked_backwards_in_two_threads_each_use_their_own_replay():
    # NOTE [Calls in the helper]: the helper's replay frames are per thread, as kernel._replay is:
    # two threads running compiled backwards with hook calls at once each get their own results
    def make(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        for p in model.parameters():
            p.register_hook(lambda g: g * 2.0)
        model[0].register_full_backward_hook(lambda m, gi, go: None)
        return model

    def grads(model, x, compiled):
        model.zero_grad(set_to_none=True)
        h = model(x)
        h.register_hook(lambda g: g + 1.0)
        if compiled:
            with ca.enable("aot_eager", fullgraph=True, background=False):
                h.pow(2).sum().backward()
        else:
            h.pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    errors = []

    def worker(seed):
        try:
            model = make(seed)
            for step in range(20):
                torch.manual_seed(seed * 100 + step)
                x = torch.randn(4, 8)
                assert_grads_equal(grads(model, x, True), grads(model, x, False), what=f"thread {seed} step {step}", exact=True)
        except BaseException as e:  # reported below
            errors.append(e)

    run_in_threads(worker, [(1,), (2,)])
    assert not errors, errors
    s = ca.stats()
    assert s.eager_fallbacks == 0 and s.captures <= 2 and s.hits >= 36, s  # (both may capture at once)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_hooks_called_from_a_graph_see_no_python_object_in_the_thread_local_state(backend):
    """issue 36 item 7 (NOTE [No Python object in the backward's thread-local state]): work a
    hook launches (DDP's allreduce) copies the thread-local state; torch's engine entry stashes
    the contextvars context there, and a gloo worker dropping the last copy at exit then needs
    the GIL the main thread holds in ~ProcessGroupGloo: a hang. Eager's hooks see it stashed;
    ours, called from the compiled graph, must not, on the capture and on the hit."""
    seen = []
    w = leaf(3)
    w.register_hook(lambda g: seen.append(torch._C._is_key_in_tls("context")))
    h = leaf(3)
    for step in range(2):
        x = torch.randn(3)
        with ca.enable(backend, fullgraph=True):
            y = w * x
            y.register_hook(lambda g: seen.append(torch._C._is_key_in_tls("context")))
            (y * h).sum().backward()
    assert seen == [False] * 4, seen
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s
    (w * x).sum().backward()  # eager's engine does stash it (what this test guards against)
    assert seen[-1] is True


def test_the_helper_reads_the_call_tuples_by_field_name():
    """NOTE [Calls in the helper]: the native helper finds each field of values.Slot,
    protocol.ReplayFrame and values.SlotKind by its name, given when it is installed: a renamed
    field is refused at once, by name, never read from another position."""
    from collections import namedtuple

    from compiled_autograd.values import Slot

    native = kernel.native_calls()
    renamed = namedtuple("Slot", [f if f != "n_resume" else "resume_count" for f in Slot._fields])
    table = kernel._native_table(None)
    try:
        with pytest.raises(RuntimeError, match="reads a field 'n_resume'"):
            native.install_calls({**table, "slot_fields": renamed._fields})
        reordered = tuple(reversed(Slot._fields))
        native.install_calls({**table, "slot_fields": reordered})  # (any order: by name)
    finally:
        kernel.install_native(native)
