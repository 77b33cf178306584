"""Background compiles (NOTE [Background compile]): the traced graph serves backwards until
the compiled one takes over; a failed compile keeps it; the user's random numbers are left
alone; an exit while one runs is quiet (tests/test_exit.py: the rest)."""

import contextlib
import os

import pytest
import torch

import compiled_autograd as ca


def test_background_compile_serves_the_traced_graph_then_switches():
    import threading

    release = threading.Event()
    compiled = []

    def slow_backend(gm, example_inputs):
        release.wait(30)  # a compile that takes a while
        compiled.append(gm)
        return gm

    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    want = torch.autograd.grad((x @ w).tanh().sum(), w)[0]
    with ca.enable(slow_backend, background=True):
        (x @ w).tanh().sum().backward()  # returns before the compile finishes
        assert ca.stats().compiles_pending == 1 and not ca.graphs()[0].compiled
        torch.testing.assert_close(w.grad, want)
        w.grad = None
        release.set()
        assert ca.synchronize(timeout=30)
        assert ca.graphs()[0].compiled and len(compiled) == 1
        (x @ w).tanh().sum().backward()
    torch.testing.assert_close(w.grad, want)
    s = ca.stats()
    assert (s.captures, s.hits, s.compiles_pending, s.eager_fallbacks) == (1, 1, 0, 0)


def test_background_compile_starts_after_the_first_replay_and_not_for_a_graph_that_raised():
    # NOTE [Background compile]: the compile thread would take the GIL from the first
    # backward's replay; it starts once that replay is done, and a graph whose first run
    # raised (a hook's error) is not compiled at all: the next backward traces it again
    started = []

    def backend(gm, example_inputs):
        started.append(len(log))
        return gm

    log = []
    w = torch.randn(4, requires_grad=True)

    def hook(g):
        log.append("hook")
        if len(log) == 1:
            raise ValueError("first backward's hook")
        return g

    with ca.enable(backend, background=True):
        y = w.exp()
        y.register_hook(hook)
        with pytest.raises(ValueError, match="first backward's hook"):
            y.sum().backward()
        assert ca.synchronize(timeout=30) and started == [] and ca.stats().compiles_pending == 0
        for _ in range(2):
            y = w.exp()
            y.register_hook(hook)
            y.sum().backward()
            assert ca.synchronize(timeout=30)
    assert started == [2], started  # compiled once, after the replay that ran the hook
    torch.testing.assert_close(w.grad, 2 * w.detach().exp())
    s = ca.stats()
    assert (s.captures, s.hits, s.compile_failures, s.eager_fallbacks) == (2, 1, 0, 0), s


def test_background_compile_failure_keeps_the_traced_graph():
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler today")

    w = torch.randn(4, requires_grad=True)
    with ca.enable(broken, background=True):
        for _ in range(3):
            w.exp().sum().backward()
            ca.synchronize()
    torch.testing.assert_close(w.grad, 3 * w.detach().exp())
    s = ca.stats()
    assert (s.captures, s.hits, s.compile_failures, s.eager_fallbacks) == (1, 2, 1, 0)


def test_a_background_compile_leaves_the_users_random_numbers_alone():
    # NOTE [A background compile leaves the random state alone]: AOTAutograd and inductor wrap
    # their work in dynamo's preserve_rng_state, which sets the global generator back to where
    # it was when the compile started; in a background compile that undid the user's draws of
    # meanwhile (dropout masks, shuffles), and the next ones repeated them. The backend here
    # does what they do, and stays inside until the user's thread has drawn (events, not time)
    import threading

    inside, drawn = threading.Event(), threading.Event()

    def slow_backend(gm, example_inputs):
        with torch._dynamo.utils.preserve_rng_state():
            inside.set()
            assert drawn.wait(30)
        return gm

    w = torch.randn(16, 16, requires_grad=True)

    def run(compiled):
        """The user's draws: 15 while the compile is inside preserve_rng_state (as many in
        eager), then 20 more once it has ended, then the next step's forward and backward
        (through the compiled graph) and 20 more."""
        torch.manual_seed(0)
        draws = []
        for step in range(2):
            loss = torch.nn.functional.dropout(torch.randn(8, 16) @ w, 0.5, training=True).tanh().sum()
            with ca.enable(slow_backend, background=True) if compiled else contextlib.nullcontext():
                loss.backward()
            if step == 0:
                if compiled:
                    assert inside.wait(30)
                draws += [torch.rand(1).item() for _ in range(15)]
                if compiled:
                    assert ca.stats().compiles_pending == 1  # (drawn while the compile ran)
                    drawn.set()
                    assert ca.synchronize(timeout=30)
            draws += [torch.rand(1).item() for _ in range(20)]
        return draws

    got = run(True)
    want = run(False)
    assert got == want
    s = ca.stats()
    assert (s.captures, s.hits, s.compiles_pending) == (1, 1, 0), s


@pytest.mark.slow
def test_background_compile_cut_short_by_exit_is_quiet(tmp_path):
    # A script that ends while a background compile runs: the exit waits for it (NOTE
    # [Background compiles at exit]), while torch's executors refuse new work (seen: "cannot
    # schedule new futures after interpreter shutdown"), which is no failure to warn about;
    # one that fails while the script runs still warns. (tests/test_exit.py: the rest.)
    import subprocess
    import sys

    script = tmp_path / "ends_early.py"
    script.write_text(
        "import sys, threading, torch, compiled_autograd as ca\n"
        "exiting = threading.Event()\n"
        "def backend(gm, example_inputs):\n"
        "    if sys.argv[1] == 'exit':\n"
        "        assert exiting.wait(60)  # (the interpreter's shutdown has begun)\n"
        "    raise RuntimeError('torn down')\n"
        "w = torch.randn(4, requires_grad=True)\n"
        "with ca.enable(backend, background=True, disk_cache=False):\n"
        "    w.exp().sum().backward()\n"
        "# threading runs its exit hooks in reverse: this one, registered after compiled_autograd's\n"
        "# (at its first background compile), runs first, before that one waits for the compile\n"
        "threading._register_atexit(exiting.set)\n"
        "if sys.argv[1] == 'run':\n"
        "    ca.synchronize(30)\n"
        "print('failures', ca.stats().compile_failures, flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for mode, warned in (("exit", False), ("run", True)):
        r = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert ("background compile failed" in r.stderr) == warned, (mode, r.stderr)
    assert "failures 1" in r.stdout
