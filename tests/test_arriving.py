"""NOTE [Tensors whose data arrives during the backward] (capture/passes.py) in one process:
FSDP2's pattern without a process group. A saved tensor's storage is freed after the forward
and refilled by a hook that runs before its node (FSDP2's pre-backward all-gather), then freed
again by a hook after it (FSDP2's reshard)."""

from __future__ import annotations

import pytest
import torch

import compiled_autograd as ca
from helpers import compare


def _free(t):
    t.untyped_storage().resize_(0)


def _refill(t, source):
    t.untyped_storage().resize_(source.numel() * source.element_size())
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):  # as FSDP2 does
        t.copy_(source)


def _step(step, scope, refill_at="output hook", reshard=True, h_hook=True):
    torch.manual_seed(step)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)  # the sharded parameter, here whole
    unsharded = w.detach().clone()  # what the all-gather fills
    h = torch.nn.functional.linear(x, unsharded)  # LinearBackward saves it (for x's grad)
    if h_hook:
        h.register_hook(lambda g: g * 1.0)
    y = (h * w.sum()).tanh()  # w takes part: its grad flows too
    _free(unsharded)
    if refill_at == "output hook":
        y.register_hook(lambda g: _refill(unsharded, w.detach()))
    if reshard:
        x.register_hook(lambda g: _free(unsharded))
    with scope:
        y.sum().backward()
    return x.grad, w.grad, unsharded.untyped_storage().nbytes()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_saved_tensor_refilled_by_a_hook_is_read_after_it(backend):
    """Compiled with no fallback, bitwise eager's, a hit on the second step with new data;
    the hook after the node frees the storage again, as eager leaves it."""
    compare(_step, backend, steps=2, captures=1, hits=1)


def _raises(compiled, **kw):
    scope = ca.enable("aot_eager") if compiled else torch.enable_grad()
    with pytest.raises(RuntimeError) as e:
        _step(0, scope, **kw)
    return str(e.value)


def test_a_saved_tensor_no_hook_refills_raises_as_eager():
    """A hook runs before the node but leaves the storage empty: the call that hands the
    tensor to the graph raises (eager's kernel fails on the empty storage)."""
    ca.reset()
    assert "storage" in _raises(False, refill_at=None, reshard=False)
    assert "storage" in _raises(True, refill_at=None, reshard=False)
    s = ca.stats()
    assert (s.eager_fallbacks, s.captures) == (0, 1), s


def test_a_saved_tensor_read_before_any_hook_falls_back():
    """No hook runs before the node: the graph would read the empty storage before any call.
    It falls back to eager, which raises its own error (under fullgraph: the reason)."""
    ca.reset()
    want = _raises(False, refill_at=None, reshard=False, h_hook=False)
    assert _raises(True, refill_at=None, reshard=False, h_hook=False) == want
    with pytest.raises(ca.CompiledAutogradError, match="data arrives during the backward"):
        _step(0, ca.enable("aot_eager", fullgraph=True), refill_at=None, reshard=False, h_hook=False)
    assert ca.stats().captures == 0
