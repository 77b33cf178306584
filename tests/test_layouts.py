"""Cases the op databases miss, where a compiled autograd goes wrong silently:
layouts, views as leaves, geometry-dependent backwards, mixed dtypes, empty
tensors, integer inputs. Every layout runs twice with new values; layouts are
interleaved so that a wrongly shared cache entry would be used for the wrong
layout."""

import pytest
import torch
import torch.nn.functional as F

import compiled_autograd as ca
from helpers import assert_grads_equal, grads_of


def _layouts(shape):
    """name -> function producing a tensor of `shape` in that layout (fresh values)."""
    n = len(shape)

    def contiguous():
        return torch.randn(*shape)

    def transposed():
        return torch.randn(*reversed(shape)).permute(*reversed(range(n)))

    def sliced_offset():
        big = torch.randn(*[s + 2 for s in shape])
        return big[tuple(slice(1, 1 + s) for s in shape)]

    def expanded():
        return torch.randn(*shape[:-1], 1).expand(*shape)

    out = {"contiguous": contiguous, "transposed": transposed, "sliced_offset": sliced_offset, "expanded": expanded}
    if n == 4:
        out["channels_last"] = lambda: torch.randn(*shape).to(memory_format=torch.channels_last)
    return out


def run_layouts(shape, fn, leaf_layouts=True):
    """For each layout of the non-leaf input (and of the leaf, if allowed),
    compare compiled and eager over two rounds through the cache."""
    layouts = _layouts(shape)
    for rnd in range(2):
        for name, make in layouts.items():
            x = make()
            w = make().requires_grad_() if leaf_layouts and name != "expanded" else torch.randn(*shape).requires_grad_()
            w.grad = None
            fn(x, w).backward()
            want = grads_of([w])
            w.grad = None
            loss = fn(x, w)
            with ca.enable("eager", fullgraph=True):
                loss.backward()
            assert_grads_equal(grads_of([w]), want, what=f"{name} round {rnd}", exact=True)
            assert w.grad.stride() == want[0].stride(), name
    s = ca.stats()
    assert s.eager_fallbacks == 0
    assert s.hits >= len(layouts), s  # the second round hits


@pytest.mark.parametrize(
    "name, fn",
    [
        ("mul", lambda x, w: (x * w).sum()),
        ("matmul", lambda x, w: (x @ w.transpose(-1, -2)).pow(2).sum()),
        ("sum_dim", lambda x, w: (x * w).sum(0).pow(2).sum()),
        ("as_strided", lambda x, w: (x + w).as_strided((2, 2), (1, 2), 1).pow(2).sum()),
        ("view_after_contiguous", lambda x, w: (x * w).contiguous().view(-1).pow(2).sum()),
        ("index", lambda x, w: (x * w)[torch.tensor([1, 0, 2])].pow(2).sum()),
        ("inplace_on_view", lambda x, w: _inplace(x, w)),
    ],
)
def test_ops_across_layouts(name, fn):
    run_layouts((3, 4), fn)


def _inplace(x, w):
    z = w * 1
    z[:, 1:3].mul_(x[:, :2])
    return z.pow(2).sum()


def test_conv_across_layouts():
    def fn(x, w):
        return F.conv2d(x, w[:, :3, :3, :3] if w.shape[1] > 3 else w, padding=1).pow(2).mean()

    layouts = _layouts((2, 3, 6, 6))
    for rnd in range(2):
        for name, make in layouts.items():
            x = make()
            w = torch.randn(4, 3, 3, 3).requires_grad_()
            if name == "channels_last":
                w = w.detach().to(memory_format=torch.channels_last).requires_grad_()
            fn(x, w).backward()
            want = grads_of([w])
            w.grad = None
            loss = fn(x, w)
            with ca.enable("eager", fullgraph=True):
                loss.backward()
            assert_grads_equal(grads_of([w]), want, what=f"{name} round {rnd}", exact=True)
            assert w.grad.stride() == want[0].stride()


def test_leaf_that_is_a_view():
    base = torch.randn(6, 4)
    for rnd in range(2):
        w = base[1:4].detach().requires_grad_()  # a leaf that is a view of another tensor
        x = torch.randn(3, 4)
        (x * w).exp().sum().backward()
        want = grads_of([w])
        w.grad = None
        loss = (x * w).exp().sum()
        with ca.enable("eager", fullgraph=True):
            loss.backward()
        assert_grads_equal(grads_of([w]), want, exact=True)
    assert ca.stats().hits == 1


def test_mixed_dtypes_and_promotion():
    for rnd in range(2):
        a = torch.randn(3, 4, dtype=torch.float16, requires_grad=True)
        b = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
        c = torch.randn(4, dtype=torch.float64, requires_grad=True)
        f = lambda: ((a.float() * b) + c).sum() + (a * 2).sum()  # noqa: E731
        f().backward()
        want = grads_of([a, b, c])
        a.grad = b.grad = c.grad = None
        loss = f()
        with ca.enable("eager", fullgraph=True):
            loss.backward()
        assert_grads_equal(grads_of([a, b, c]), want, exact=True)
    assert (ca.stats().captures, ca.stats().hits) == (1, 1)


def test_zero_size_tensors():
    for rnd in range(2):
        a = torch.randn(0, 4, requires_grad=True)
        b = torch.randn(4, 3, requires_grad=True)
        f = lambda: (a @ b).sum() + b.sum()  # noqa: E731
        f().backward()
        want = grads_of([a, b])
        a.grad = b.grad = None
        loss = f()
        with ca.enable("eager", fullgraph=True):
            loss.backward()
        assert_grads_equal(grads_of([a, b]), want, exact=True)


def test_integer_and_bool_inputs_and_outputs_without_grad():
    w = torch.randn(5, 3, requires_grad=True)
    for rnd in range(2):
        idx = torch.randint(0, 5, (7,))
        mask = torch.rand(7, 3) > 0.5
        f = lambda: (w[idx] * mask).sum() + (w.detach() * 2).sum()  # noqa: E731
        f().backward()
        want = grads_of([w])
        w.grad = None
        loss = f()
        with ca.enable("eager", fullgraph=True):
            loss.backward()
        assert_grads_equal(grads_of([w]), want, exact=True)
        w.grad = None
    assert (ca.stats().captures, ca.stats().hits) == (1, 1)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_saved_views_of_another_dtype(backend):
    """Found by the fuzzer: `.abs()` of `view_as_complex(x)` saves a complex view of a
    real tensor, which torch fakeifies by replaying the view and fails on (NOTE [Views
    that change the dtype]); every such backward ran in eager."""
    from helpers import parity

    w = torch.randn(6, 4, requires_grad=True)

    def loss(x):
        h = x * w
        c = torch.view_as_complex(h.reshape(-1, 2)[1:])  # (an offset, too)
        r = torch.view_as_real(c * c.conj() + c * 1j)
        return c.abs().sum() + r.pow(2).sum() + h.view(torch.int32).shape[0]

    parity(loss, [w], lambda s: (torch.randn(6, 4, generator=torch.Generator().manual_seed(s)),), backend=backend)
