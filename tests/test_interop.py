"""Ours and torch's built-in compiled autograd in one process.

A node type's functional form is bound once per process, by whichever compiled
autograd traces it first (NOTE [Sharing functionals with torch's compiled
autograd], native/trace.cpp). Which one that is depends on everything the process
did before, so each order runs in a fresh interpreter.
"""

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    import torch
    import compiled_autograd as ca
    import torch._dynamo.compiled_autograd as tca

    warnings.filterwarnings("error", message="compiled_autograd: running a backward")  # our fallback
    torch.manual_seed(0)
    w = torch.randn(5, 5, requires_grad=True)

    def loss(x):
        return (x @ w).sin().mean()

    def eager_grad(x):
        w.grad = None
        loss(x).backward()
        return w.grad.clone()

    def ours(x):
        w.grad = None
        with ca.enable(backend="eager"):
            loss(x).backward()
        return w.grad.clone()

    def theirs(x):
        w.grad = None
        with tca._enable(torch.compile(backend="eager")):
            loss(x).backward()
        return w.grad.clone()

    runs = {"o": ours, "t": theirs}
    for who in sys.argv[1]:
        for x in (torch.randn(3, 5), torch.randn(3, 5)):  # the second is a cache hit
            torch.testing.assert_close(runs[who](x), eager_grad(x), rtol=0, atol=0)
    s = ca.stats()
    assert s.eager_fallbacks == 0 and s.opaque_nodes == 0, s
    assert s.captures == 1 and s.hits == sum(c == "o" for c in sys.argv[1]) * 2 - 1, s
    print("ok")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["ot", "to", "otot"])
def test_both_compiled_autograds_in_one_process(order):
    r = subprocess.run([sys.executable, "-c", SCRIPT, order], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


class _WatchedLock:
    """A lock of compiled_autograd's that sets `asked` when `thread` asks for it: a test then
    knows that thread has reached it (waiting, or holding it)."""

    def __init__(self, lock, thread_name):
        self.lock, self.thread_name, self.asked = lock, thread_name, threading.Event()

    def __enter__(self):
        if threading.current_thread().name == self.thread_name:
            self.asked.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_fx_traces_in_two_threads_do_not_corrupt_each_other(monkeypatch):
    """NOTE [One fx trace at a time]: trace A starts, trace B starts in another thread, A ends
    first. Without the lock, A's exit takes B's patcher from torch.fx's process global and B
    fails with "CURRENT_PATCHER is None in finally block" (a capture racing a background
    compile did, in a conformance run), and the "fx trace running" flag stays set. Events
    order it: B's trace begins (it asks for the lock, or, without one, enters its function)
    while A is inside its own, and only then does A end."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from compiled_autograd.compile import torch_patches  # (installs the lock)

    lock = _WatchedLock(torch_patches.trace_lock, "b")
    monkeypatch.setattr(torch_patches, "trace_lock", lock)
    go = {"a": threading.Event(), "b": threading.Event()}
    inside_a = threading.Event()
    errors = []
    original_call = torch.nn.Module.__call__

    def traced(name):
        def fn(x):
            (inside_a if name == "a" else lock.asked).set()
            go[name].wait(10)
            return x.sin()

        def run():
            try:
                make_fx(fn)(torch.randn(3))
            except Exception as e:  # pragma: no cover - the failure this test is about
                errors.append(e)

        return threading.Thread(target=run, name=name)

    a, b = traced("a"), traced("b")
    a.start()
    assert inside_a.wait(10)  # A's trace is running
    b.start()
    assert lock.asked.wait(10)  # B's has begun
    go["a"].set()
    a.join(10)
    go["b"].set()
    b.join(10)
    assert not errors, errors
    assert torch.nn.Module.__call__ is original_call
    # B saved the flag A had set and restored it after A's end: a torch.compile'd function
    # called after that raised "using FX to symbolically trace a dynamo-optimized function"
    assert not torch.fx._symbolic_trace.is_fx_tracing()


def test_an_fx_trace_in_another_thread_leaves_this_threads_modules_alone():
    """NOTE [One fx trace at a time]: while a background compile traces (AOTAutograd's make_fx
    inside inductor), the user's thread runs its next forward. torch.fx patches
    `nn.Module.__call__` and sets its "a trace is running" flag for the whole process: a
    torch.compile'd module called meanwhile raised "Detected that you are using FX to
    symbolically trace a dynamo-optimized function", and a plain one ran through the other
    thread's tracer. Both are confined to the tracing thread."""
    import threading

    from torch.fx.experimental.proxy_tensor import make_fx

    import compiled_autograd  # noqa: F401  (confines fx's patches)

    inside, release = threading.Event(), threading.Event()
    errors, seen = [], {}

    def fn(x):
        seen["flag in trace"] = torch.fx._symbolic_trace.is_fx_symbolic_tracing()
        inside.set()
        release.wait(10)
        return x.sin()

    def run():
        try:
            seen["graph"] = make_fx(fn)(torch.randn(3))
        except Exception as e:  # pragma: no cover - the failure this test is about
            errors.append(e)

    lin = torch.nn.Linear(3, 3)
    compiled = torch.compile(torch.nn.Linear(3, 3), backend="eager")
    x = torch.randn(2, 3)
    compiled(x)  # compiled before the trace
    t = threading.Thread(target=run)
    t.start()
    try:
        assert inside.wait(10)
        assert not torch.fx._symbolic_trace.is_fx_symbolic_tracing()
        torch.testing.assert_close(compiled(x), torch.nn.functional.linear(x, compiled.weight, compiled.bias))
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        # compiled during the trace, its submodules' calls inlined: dynamo takes the original
        # `Module.__call__` (before: a graph break in the patched one, on threading.get_ident)
        seq = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
        seq.compile(backend="eager", fullgraph=True)  # (Module.compile: `_call_impl` traced, the submodules' calls inlined)
        out = seq(x)
        torch.testing.assert_close(out, torch.relu(torch.nn.functional.linear(x, seq[0].weight, seq[0].bias)))
    finally:
        release.set()
        t.join(10)
    assert not errors, errors
    assert seen["flag in trace"]
    assert [n.target for n in seen["graph"].graph.nodes if n.op == "call_function"] == [torch.ops.aten.sin.default]


def test_the_users_torch_compile_waits_for_a_background_compile(monkeypatch):
    """NOTE [One compile at a time]: torch's compilers keep fx's node-meta state in process
    globals, which inductor's compile sets and restores (`preserve_node_meta`) for its whole
    length. With one of our compiles running in the background, most of the user's
    torch.compile'd training functions compiled meanwhile failed ("Expected current_level >
    0": the joint graph's backward found the meta the other thread had restored). The backend
    here does what inductor's compile does to that state, over and over, until the user's
    first compile has begun (it asks for the compile lock; without the lock it would run
    meanwhile, for up to 10 s); the user's compiles wait."""
    import compiled_autograd as ca
    from compiled_autograd.compile import torch_patches

    lock = _WatchedLock(torch_patches.compile_lock, threading.current_thread().name)  # (the user's thread)
    monkeypatch.setattr(torch_patches, "compile_lock", lock)
    started = threading.Event()

    def busy_backend(gm, example_inputs):
        started.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with torch.fx.traceback.preserve_node_meta():
                if lock.asked.wait(0.001):
                    break
        return gm

    w = torch.randn(8, 8, requires_grad=True)
    for step in range(2):  # the second backward a hit of the first's entry
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        w.grad = None
        (x @ w).tanh().sum().backward()
        want, w.grad = w.grad, None
        loss = (x @ w).tanh().sum()
        with ca.enable(busy_backend, background=True):
            loss.backward()
        torch.testing.assert_close(w.grad, want)
        if step == 0:
            assert started.wait(10)
            errors = []
            for i in range(4):  # new frames: the first asked to compile while ours ran
                torch._dynamo.reset()
                f = torch.compile(lambda x, w: (x @ w).sin().exp().sum() * (i + 1), backend="aot_eager")
                try:
                    w.grad = None
                    f(x, w).backward()
                    torch.testing.assert_close(w.grad, torch.func.grad(lambda w: (x @ w).sin().exp().sum() * (i + 1))(w))
                except Exception as e:  # noqa: BLE001 - the failure this test is about
                    errors.append(f"{type(e).__name__}: {str(e).splitlines()[:2]}")
            assert not errors, errors
            assert lock.asked.is_set()
    s = ca.stats()
    assert (s.captures, s.hits, s.compile_failures) == (1, 1, 0), s
