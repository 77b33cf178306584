"""A compiled graph slower than eager is set aside (issue 47; NOTE [A compiled graph slower than
eager], cache/memory.py): once a graph compiled in the background lands, its backwards take turns
with eager's, both timed; a compiled graph whose backwards take longer runs eager from then on,
said in explain()."""

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


def _train(backend, steps, while_compiling_s=0.0):
    """The steps' grads: under ca.enable(backend) (background compile), or in eager (None). Each
    backward takes `while_compiling_s` more while a compile is pending (a hook: the machine
    shared with the compile)."""
    import contextlib

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if while_compiling_s:

        def shared_machine(p):
            if ca.stats().compiles_pending:
                time.sleep(while_compiling_s)

        m[0].bias.register_post_accumulate_grad_hook(shared_machine)
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
    got = _train(_slow_backend, 40)
    for step, (g, w) in enumerate(zip(got, _train(None, 40))):
        for a, b in zip(g, w):
            assert torch.equal(a, b), f"step {step}"
    s = ca.stats()
    assert s.eager_while_compiling >= 3, s
    assert s.captures == 1 and s.eager_turns == 5 and s.hits == 6, s  # (in turns: the compiled graph's first, then 5 of each)
    assert s.fallback_reasons["slower than eager"] >= 5 and s.eager_fallbacks == s.fallback_reasons["slower than eager"], s
    text = ca.explain(file=None)
    assert "slower than eager" in text and "judged in turns with eager" in text and ": set aside" in text, text


def test_steps_slowed_while_compiling_are_not_the_baseline():
    """The backwards that ran in eager while the graph compiled shared the machine with the
    compile (here 60 ms more each): a compiled graph 30 ms slower than eager is still set aside."""
    got = _train(_slow_backend, 40, while_compiling_s=0.06)
    for step, (g, w) in enumerate(zip(got, _train(None, 40))):
        for a, b in zip(g, w):
            assert torch.equal(a, b), f"step {step}"
    s = ca.stats()
    assert s.eager_while_compiling >= 3 and s.eager_turns == 5, s
    assert (s.captures, s.hits) == (1, 6) and s.fallback_reasons["slower than eager"] >= 5, s
    assert s.eager_fallbacks == s.fallback_reasons["slower than eager"], s  # (no other fallback)


def test_the_verdict_compares_medians_of_turns_leaving_out_the_first_compiled_run():
    from types import SimpleNamespace

    from compiled_autograd.cache.memory import Payback

    compiled = SimpleNamespace(compiled=True)
    eager_times = [0.010, 0.011, 0.010, 0.009, 0.010]
    for step, times, slower in [
        (3, [0.5, 0.010, 0.010, 0.011, 0.009, 0.010], False),  # (a slow first run: left out)
        (4, [0.010, 0.012, 0.012, 0.013, 0.012, 0.012], True),
    ]:
        p = Payback()
        assert p.turn(compiled) is None  # (no background compile: kept, not judged)
        for _ in range(step):  # (the backwards that ran in eager while it compiled: as many as steps before it landed)
            p.compiling()
        assert p.turn(SimpleNamespace(compiled=False)) is None and p.count == step
        turns, decided = [], []
        while p.verdict is None:
            turn = p.turn(compiled)
            turns.append((p.count, turn))
            decided.append(p.note(turn, times.pop(0) if turn == "compiled" else eager_times[len(p.eager)]))
        # the compiled graph's first run, then eager at the even counts of the key's backwards since it began to
        # compile, whichever step it landed at (ranks that step together take the same turns)
        assert turns[0][1] == "compiled" and [t for _, t in turns].count("eager") == 5 and len(turns) == 11
        assert all((count % 2 == 0) == (turn == "eager") for count, turn in turns[1:]), turns
        assert decided[-1] == slower and not any(decided[:-1])
        assert bool(p.verdict) == slower and p.turn(compiled) is None
