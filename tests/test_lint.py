"""The graph lint (NOTE [The layout of a call's arguments], capture/lint.py): every capture of
the suite is linted (conftest.py sets COMPILED_AUTOGRAD_LINT=1); here, that it passes a graph
whose calls carry ordering, watched and passed arguments, and names what a broken layout breaks."""

import pytest
import torch

import compiled_autograd as ca
from compiled_autograd.capture.lint import GraphLintError, lint


def _graph_with_calls():
    """A graph whose hook call comes between reads of saved tensors: ordering arguments before
    it, a watched saved tensor after it; two backwards through one entry."""
    w = torch.randn(4, 4, requires_grad=True)
    for _ in range(2):
        x = torch.randn(3, 4, requires_grad=True)
        h = (x @ w).tanh()
        h.register_hook(lambda g: g * 2)
        with ca.enable("eager", fullgraph=True):
            (h @ w).sum().backward()
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s
    (entry,) = ca.graphs()
    return entry


def test_lint_passes_a_graph_with_ordering_and_watched_arguments():
    entry = _graph_with_calls()
    slots = entry.plan.slots
    assert any(s.n_after for s in slots) and any(s.n_watch for s in slots), slots
    lint(entry.graph, slots)


@pytest.mark.parametrize(
    "broken, what",
    [
        (lambda s: s._replace(n_watch=s.n_watch + 1), "is not a graph input"),
        (lambda s: s._replace(n_after=s.n_after + 40), "fewer than its slot's"),
        (lambda s: s._replace(fresh=True), "is marked fresh"),
        (lambda s: s._replace(kind="no_such_kind"), "is no family's"),
    ],
)
def test_lint_names_the_call_a_broken_layout_breaks(broken, what):
    entry = _graph_with_calls()
    slots = list(entry.plan.slots)
    k = next(i for i, s in enumerate(slots) if s.n_watch)
    slots[k] = broken(slots[k])
    with pytest.raises(GraphLintError, match=what) as e:
        lint(entry.graph, tuple(slots))
    assert f"(slot {k})" in str(e.value) and "def forward" in str(e.value)
    with pytest.raises(GraphLintError, match="have no call in the graph"):
        lint(entry.graph, tuple(entry.plan.slots) + (entry.plan.slots[0],))
