"""A script that exits while a background compile runs: the compile is waited for (up to
COMPILED_AUTOGRAD_EXIT_WAIT seconds), then cancelled between Python steps, never abandoned
inside C++ code ("terminate called without an active exception", exit status 134)."""

import os
import subprocess
import sys

import pytest

# after threading's shutdown (where pending compiles are waited for), an atexit handler
# reports what is left
REPORT = (
    "import atexit, compiled_autograd as ca\n"
    "atexit.register(lambda: print('at exit: pending', ca.stats().compiles_pending, "
    "'failures', ca.stats().compile_failures, 'hits', ca.stats().hits, flush=True))\n"
)


def _run(tmp_path, body: str, wait: str, runs: int = 1):
    script = tmp_path / "exits_early.py"
    script.write_text(REPORT + body)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(sys.path),
        COMPILED_AUTOGRAD_EXIT_WAIT=wait,
        COMPILED_AUTOGRAD_DISK_CACHE="0",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    out = []
    for _ in range(runs):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
        assert "terminate called" not in r.stderr, r.stderr
        assert r.returncode == 0, r.stderr[-3000:]
        out.append(r)
    return out


@pytest.mark.slow
@pytest.mark.inductor
def test_exit_waits_for_an_inductor_background_compile(tmp_path):
    # a small graph compiled by inductor in the background; the script ends at once
    body = (
        "import torch\n"
        "w = torch.randn(64, 64, requires_grad=True)\n"
        "with ca.enable('inductor', background=True):\n"
        "    (torch.randn(32, 64) @ w).tanh().sum().backward()\n"
        "print('pending', ca.stats().compiles_pending, flush=True)\n"
    )
    for r in _run(tmp_path, body, wait="300", runs=2):
        assert "pending 1" in r.stdout, r.stdout  # (still compiling when the script ended)
        assert "at exit: pending 0 failures 0" in r.stdout, (r.stdout, r.stderr[-3000:])
        assert "background compile failed" not in r.stderr, r.stderr


BUSY = (
    "import threading, torch\n"
    "started = threading.Event()\n"
    "def busy_backend(gm, example_inputs):\n"
    "    a = torch.randn(256, 256)\n"
    "    started.set()\n"
    "    for _ in range(10**7):  # torch ops: C++ code run without the GIL\n"
    "        a = torch.mm(a, a).clamp_(-1, 1)\n"
    "    return gm\n"
    "w = torch.randn(8, 4, requires_grad=True)\n"
    "with ca.enable(busy_backend, background=True):\n"
    "    (torch.randn(3, 8) @ w).tanh().sum().backward()\n"
    "assert started.wait(60)\n"
)


@pytest.mark.slow
def test_exit_cancels_a_compile_that_outlasts_the_wait(tmp_path):
    # a compile running C++ code (without the GIL) when the interpreter ends: before, a daemon
    # thread abandoned there aborted the process at its next GIL acquisition
    (r,) = _run(tmp_path, BUSY, wait="0.5")
    assert "at exit: pending 0 failures 0" in r.stdout, (r.stdout, r.stderr[-3000:])
    assert "background compile failed" not in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("wait", ["0"])
def test_exit_wait_setting(tmp_path, wait):
    # 0: cancel at once
    (r,) = _run(tmp_path, BUSY, wait=wait)
    assert "at exit: pending 0" in r.stdout, (r.stdout, r.stderr[-3000:])


@pytest.mark.parametrize("raw, wait", [("", 10.0), ("2.5", 2.5), ("0", 0.0), ("-1", 0.0), ("inf", None), ("soon", 10.0)])
def test_exit_wait_values(monkeypatch, raw, wait):
    from compiled_autograd.compile import background

    monkeypatch.setenv("COMPILED_AUTOGRAD_EXIT_WAIT", raw)
    assert background._exit_wait() == wait
