"""The in-process capture log (`capture_log()`, read by `ca.explain()`) is bounded."""

import torch

import compiled_autograd as ca
from compiled_autograd.observe import captures
from compiled_autograd.observe.captures import capture_log


def _chain(n):
    x = torch.randn(3, requires_grad=True)
    y = x
    for _ in range(n):
        y = y.sin()
    with ca.enable("eager"):
        y.sum().backward()


def test_the_capture_log_keeps_the_newest_entries(monkeypatch):
    monkeypatch.setattr(captures, "MAX_CAPTURE_LOG", 4, raising=False)
    for n in range(1, 7):  # six structures, six captures
        _chain(n)
    assert ca.stats().captures == 6
    log = capture_log()
    assert len(log) == 4
    nodes = [c["nodes"] for c in log]
    assert nodes == sorted(nodes) and len(set(nodes)) == 4  # the last four chains, in order
    _chain(7)
    assert len(capture_log()) == 4 and capture_log()[-1]["nodes"] > nodes[-1]
    assert capture_log()[0] == log[1]


def test_a_background_compile_updates_its_own_entry(monkeypatch):
    # a compile thread holds its entry, not a position in the log: the log may be trimmed
    # (here by the next capture) while it compiles
    monkeypatch.setattr(captures, "MAX_CAPTURE_LOG", 1, raising=False)
    x = torch.randn(3, requires_grad=True)
    with ca.enable("aot_eager", background=True):
        x.sin().sum().backward()
        first = capture_log()[0]
        x.cos().exp().sum().backward()
        ca.synchronize()
    s = ca.stats()
    assert (s.captures, s.compile_failures) == (2, 0)
    (last,) = capture_log()
    assert last is not first and last["nodes"] == first["nodes"] + 1
