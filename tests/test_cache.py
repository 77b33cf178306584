"""The cache key: every baked-in value recaptures, every lifted value does not."""

import pytest
import torch
import torch.nn.functional as F

import compiled_autograd as ca
from helpers import parity


def run_both(fn, leaves, backend="eager"):
    """One eager and one compiled backward of fn() (helpers.parity, unseeded: the caller's
    random state moves on); the counters are the test's."""
    parity(fn, leaves, lambda step: (), backend, steps=1, captures=None, seed=False)


def captures_for(variants, shape=(3, 4)):
    """Run each variant (a function of the leaf) through the cache, twice each,
    with new leaf values; return the number of captures."""
    x = torch.randn(*shape, requires_grad=True)
    for rnd in range(2):
        for v in variants:
            with torch.no_grad():
                x.copy_(torch.randn(*shape))
            run_both(lambda: v(x), [x])
    s = ca.stats()
    assert s.eager_fallbacks == 0, s.fallback_reasons
    assert s.hits == 2 * len(variants) - s.captures
    return s.captures


@pytest.mark.parametrize(
    "variants",
    [
        pytest.param([lambda x: x.pow(2).sum(), lambda x: x.pow(3).sum()], id="pow_exponent"),
        pytest.param([lambda x: x.sum(0).pow(2).sum(), lambda x: x.sum(1).pow(2).sum()], id="sum_dim"),
        pytest.param(
            [lambda x: (x.sum(1, keepdim=True) * x).sum(), lambda x: (x.sum(1, keepdim=False) * x.t()).sum()],
            id="keepdim",
        ),
        pytest.param([lambda x: F.leaky_relu(x, 0.1).pow(2).sum(), lambda x: F.leaky_relu(x, 0.3).pow(2).sum()], id="leaky_slope"),
        pytest.param([lambda x: x.softmax(0)[0].sum() * 3, lambda x: x.softmax(1)[0].sum() * 3], id="softmax_dim"),
        pytest.param([lambda x: x.to(torch.float64).exp().sum(), lambda x: x.to(torch.float16).exp().float().sum()], id="dtype"),
        pytest.param([lambda x: x.clamp(min=-0.1).sum(), lambda x: x.clamp(min=0.2).sum()], id="clamp_bound"),
        pytest.param([lambda x: x.sum(-1).pow(2).sum(), lambda x: x.sum(0).pow(2).sum()], id="negative_dim"),
    ],
)
def test_changed_constant_recaptures(variants):
    assert captures_for(variants) == len(variants)


@pytest.mark.parametrize(
    "variants",
    [
        pytest.param([lambda x: (x * 2.0).pow(2).sum(), lambda x: (x * 3.0).pow(2).sum()], id="wrapped_scalar_mul"),
        pytest.param([lambda x: (x / 2.0).pow(2).sum(), lambda x: (x / 5.0).pow(2).sum()], id="wrapped_scalar_div"),
        pytest.param([lambda x: (x * torch.tensor(2.0)).sum(), lambda x: (x * torch.tensor(-4.0)).sum()], id="zero_dim_tensor"),
    ],
)
def test_lifted_scalar_does_not_recapture(variants):
    assert captures_for(variants) == 1


# -- hidden node state: fields Python cannot read, each must be in the key ------------


def test_hidden_typeandsize_index_put_values_info():
    # values_info (TypeAndSize of `values`) is hidden; values does not require grad,
    # so nothing else in the graph carries its shape
    x = torch.randn(5, 3, requires_grad=True)
    idx = torch.tensor([1, 3])
    for rnd in range(2):
        for v in (torch.randn(1), torch.randn(2, 3)):
            run_both(lambda: x.index_put((idx,), v).pow(2).sum(), [x])
    assert ca.stats().captures == 2


def test_hidden_tensor_geometry_as_strided():
    # AsStridedBackward0.self_geometry (input strides/offset) is hidden
    base = torch.randn(4, 4)
    for rnd in range(2):
        for make in (lambda: base.clone(), lambda: base.t().contiguous().t()):
            x = make().requires_grad_()
            y = x * 1  # non-leaf with x's geometry
            run_both(lambda: (x * 1).as_strided((2, 2), (1, 4), 1).pow(2).sum(), [x])
    assert ca.stats().captures == 2


def test_hidden_cat_sizes_of_non_grad_inputs():
    # CatBackward0 keeps every input's size; inputs without grad have no edge
    a = torch.randn(2, 3, requires_grad=True)
    c = torch.randn(2, 3, requires_grad=True)
    for rnd in range(2):
        for k in (1, 4):
            b = torch.randn(2, k)
            run_both(lambda: torch.cat([a, b, c], 1)[:, :3].sum() + torch.cat([a, b, c], 1)[:, -3:].pow(2).sum(), [a, c])
    assert ca.stats().captures == 2


def test_hidden_optional_bool_native_dropout_train():
    # NativeDropoutBackward0.train is hidden and changes the scale of the grad
    x = torch.randn(4, 5, requires_grad=True)
    for rnd in range(2):
        for train in (True, False):

            def f():
                torch.manual_seed(rnd)
                out, mask = torch.native_dropout(x, 0.5, train)
                return (out * torch.arange(20.0).view(4, 5)).sum()

            run_both(f, [x])
    assert ca.stats().captures == 2


def test_hidden_scalar_type_softmax_dtype():
    # SoftmaxBackward0.self_scalar_type: softmax computed in float64 from a float32 input
    x = torch.randn(3, 4, requires_grad=True)
    for rnd in range(2):
        for dt in (torch.float64, torch.float32):
            run_both(lambda: (torch.softmax(x, -1, dtype=dt) * torch.arange(12.0, dtype=dt).view(3, 4)).sum().float(), [x])
    assert ca.stats().captures == 2


def test_foreach_nodes_compile_and_key():
    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    for rnd in range(2):
        for k in (2.0, 3.0):
            run_both(lambda: sum(t.sum() for t in torch._foreach_pow(xs, k)), xs)
    s = ca.stats()
    assert s.captures == 2 and s.eager_fallbacks == 0


def test_layout_of_saved_tensor_is_in_key():
    # same shapes, different strides of a saved tensor: the mm backward branches on strides
    w = torch.randn(4, 5, requires_grad=True)
    for rnd in range(2):
        for make in (lambda: torch.randn(3, 4), lambda: torch.randn(4, 3).t()):
            a = make()
            run_both(lambda: (a @ w).pow(2).sum(), [w])
    assert ca.stats().captures == 2


def test_deterministic_algorithms_flag_is_in_key():
    x = torch.randn(6, 3, requires_grad=True)
    idx = torch.tensor([0, 2, 2, 5])
    old = torch.are_deterministic_algorithms_enabled()
    try:
        for flag in (False, True):
            torch.use_deterministic_algorithms(flag)
            run_both(lambda: x[idx].pow(2).sum(), [x])
    finally:
        torch.use_deterministic_algorithms(old)
    assert ca.stats().captures == 2


def test_backend_is_in_key():
    x = torch.randn(3, requires_grad=True)
    run_both(lambda: x.exp().sum(), [x], backend="eager")
    run_both(lambda: x.exp().sum(), [x], backend="aot_eager")
    assert ca.stats().captures == 2


def test_cache_size_limit_evicts_least_recent():
    x = torch.randn(3, requires_grad=True)
    with ca.enable("eager", cache_size_limit=2):
        for k in (2, 3, 4, 2):
            x.pow(k).sum().backward()
    s = ca.stats()
    assert s.captures == 4 and s.hits == 0  # pow 2 was evicted before its second use
