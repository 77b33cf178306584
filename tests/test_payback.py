"""A compiled graph slower than eager is set aside (issue 47; NOTE [A compiled graph slower than
eager], cache/memory.py): the backwards that ran in eager while it compiled are this run's
baseline; a compiled graph whose backwards take longer runs eager from then on, said in explain()."""

from __future__ import annotations

import time

import torch

import compiled_autograd as ca


def _slow_backend(gm, example_inputs):
    """A backend whose compile takes a while (the steps meanwhile run in eager) and whose code
    is slow: each backward 30 ms more."""
    time.sleep(1.0)

    def run(*args):
        time.sleep(0.03)
        return gm(*args)

    return run


def _train(backend, steps):
    """The steps' grads: under ca.enable(backend) (background compile), or in eager (None)."""
    import contextlib

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    grads = []
    for step in range(steps):
        torch.manual_seed(step)
        x = torch.randn(8, 16)
        m.zero_grad(set_to_none=True)
        with ca.enable(backend, background=True, disk_cache=False) if backend is not None else contextlib.nullcontext():
            m(x).square().sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
        if backend is not None:
            time.sleep(0.1)  # (so that several steps run while it compiles)
    return grads


def test_a_compiled_graph_slower_than_eager_is_set_aside():
    got = _train(_slow_backend, 30)
    for step, (g, w) in enumerate(zip(got, _train(None, 30))):
        for a, b in zip(g, w):
            assert torch.equal(a, b), f"step {step}"
    s = ca.stats()
    assert s.eager_while_compiling >= 3, s
    assert s.fallback_reasons["slower than eager"] >= 5, s  # (after the compiled graph's first 6 backwards)
    assert "slower than eager" in ca.explain()


def test_the_verdict_compares_medians_leaving_out_the_first_compiled_run():
    from types import SimpleNamespace

    from compiled_autograd.cache.memory import Payback

    compiled = SimpleNamespace(compiled=True)
    for times, slower in [
        ([0.5, 0.010, 0.010, 0.011, 0.009, 0.010], False),  # (a slow first run: left out)
        ([0.010, 0.012, 0.012, 0.013, 0.012, 0.012], True),
    ]:
        p = Payback()
        assert not p.judging(compiled)  # (no eager baseline yet)
        for t in (0.010, 0.011, 0.010):
            p.note_eager(t)
        assert p.judging(compiled) and not p.judging(SimpleNamespace(compiled=False))
        decided = [p.note_compiled(t) for t in times]
        assert decided[-1] == slower and not any(decided[:-1])
        assert bool(p.verdict) == slower and not p.judging(compiled)
