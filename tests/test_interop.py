"""Ours and torch's built-in compiled autograd in one process.

A node type's functional form is bound once per process, by whichever compiled
autograd traces it first (NOTE [Sharing functionals with torch's compiled
autograd], native/_C.cpp). Which one that is depends on everything the process
did before, so each order runs in a fresh interpreter.
"""

import subprocess
import sys
import textwrap

import pytest

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


@pytest.mark.parametrize("order", ["ot", "to", "otot"])
def test_both_compiled_autograds_in_one_process(order):
    r = subprocess.run([sys.executable, "-c", SCRIPT, order], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
