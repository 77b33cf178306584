"""Misuse raises the same error as eager (type and message)."""

import pytest
import torch

import compiled_autograd as ca
from helpers import assert_grads_equal


def eager_error(fn):
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def same_error(make_and_run):
    """make_and_run() builds a fresh graph and misuses it; compare eager vs compiled."""
    want = eager_error(make_and_run)
    with ca.enable("eager"):
        got = eager_error(make_and_run)
    assert type(got) is type(want)
    assert str(got) == str(want)
    return got


def test_backward_twice_without_retain_graph():
    def run():
        x = torch.randn(3, requires_grad=True)
        y = (x * x).sum()
        y.backward()
        y.backward()

    err = same_error(run)
    assert "second time" in str(err)


def test_retain_graph_allows_repeated_hits():
    x = torch.randn(3, requires_grad=True)
    y = (x.exp() * x).sum()
    with ca.enable("eager", fullgraph=True):
        for _ in range(3):
            y.backward(retain_graph=True)
    got, x.grad = x.grad, None
    y = (x.exp() * x).sum()
    for _ in range(3):  # eager, the same three backwards: bitwise the same
        y.backward(retain_graph=True)
    assert_grads_equal([got], [x.grad], exact=True)
    s = ca.stats()
    assert (s.captures, s.hits) == (1, 2)


def test_non_scalar_root_without_grad_tensors():
    def run():
        x = torch.randn(3, requires_grad=True)
        (x * 2).backward()

    err = same_error(run)
    assert "grad can be implicitly created only for scalar outputs" in str(err)


def test_root_that_does_not_require_grad():
    def run():
        torch.randn(3).sum().backward()

    err = same_error(run)
    assert "does not require grad" in str(err)


def test_saved_tensor_modified_in_place():
    def run():
        x = torch.randn(3, requires_grad=True)
        y = x.exp()
        z = (y * 2).sum() + y.sum()
        w = y.sin().sum()
        y.add_(1)
        w.backward()

    err = same_error(run)
    assert "modified by an inplace operation" in str(err)


def test_grad_unreachable_input():
    def run():
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        torch.autograd.grad((a * 2).sum(), [a, b])

    err = same_error(run)
    assert "appears to not have been used in the graph" in str(err)


def test_grad_unreachable_input_allow_unused():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    with ca.enable("eager", fullgraph=True):
        ga, gb = torch.autograd.grad((a * 2).sum(), [a, b], allow_unused=True)
    assert gb is None
    torch.testing.assert_close(ga, torch.full((3,), 2.0))
    assert ca.stats().eager_fallbacks == 0


def test_grad_input_that_does_not_require_grad():
    def run():
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3)
        torch.autograd.grad((a * 2).sum(), [a, b])

    same_error(run)


def test_grad_tensors_shape_mismatch():
    def run():
        x = torch.randn(3, requires_grad=True)
        (x * 2).backward(torch.ones(4))

    same_error(run)


def test_unknown_backend_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="eager, aot_eager, inductor"):
        ca.enable("tvm")
