"""On a CUDA device: parity with eager through one cache entry, hooks, mixed devices, streams, memory.

Skipped where there is no CUDA device (CI has none); run on a GPU machine with
`python -m pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import compiled_autograd as ca
from helpers import INDUCTOR, assert_grads_equal, grads_of, parity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"
# (inductor compiles in the foreground: both backwards run its CUDA code)
TOL = dict(rtol=1e-4, atol=1e-5, background=False)


@pytest.fixture(autouse=True)
def _fresh():
    ca.reset()
    yield
    ca.reset()


def _mlp(d=64, layers=3):
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))]).to(DEV)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", INDUCTOR])
def test_mlp(backend):
    net = _mlp()
    parity(lambda x: net(x).pow(2).mean(), net.parameters(), lambda s: (torch.randn(16, 64, device=DEV) + s,), backend=backend, **TOL)


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_transformer_layer(backend):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).to(DEV)
    parity(
        lambda x: layer(x).square().mean(),
        layer.parameters(),
        lambda s: (torch.randn(4, 16, 64, device=DEV) * (s + 1),),
        backend=backend,
        **TOL,
    )


@pytest.mark.inductor
def test_cnn_inductor():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
    ).to(DEV)
    parity(lambda x: net(x).mean(), net.parameters(), lambda s: (torch.randn(4, 3, 16, 16, device=DEV) + s,), backend="inductor", **TOL)


@pytest.mark.inductor
def test_autocast_bf16_inductor():
    net = _mlp()

    def loss(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return net(x).float().pow(2).mean()

    parity(
        loss, net.parameters(), lambda s: (torch.randn(16, 64, device=DEV) - s,), backend="inductor", rtol=2e-2, atol=2e-3, background=False
    )


@pytest.mark.inductor
def test_hooks_inductor():
    """Tensor hooks on parameters, a module's full backward hook and post-accumulate hooks: calls
    out of the compiled CUDA code, their results conformed to the graph's devices."""
    net = _mlp()
    seen = []
    for p in net.parameters():
        p.register_hook(lambda g: g.clamp(-1e-2, 1e-2))
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.device.type))
    net[1].register_full_backward_hook(lambda m, gi, go: (gi[0] * 2,))
    parity(
        lambda x: net(x).pow(2).mean(), net.parameters(), lambda s: (torch.randn(16, 64, device=DEV) * (s + 1),), backend="inductor", **TOL
    )
    assert seen and set(seen) == {torch.device(DEV).type}


@pytest.mark.inductor
def test_cpu_and_cuda_in_one_graph():
    torch.manual_seed(0)
    a = torch.randn(8, 8, requires_grad=True)  # on the CPU
    b = torch.randn(8, 8, device=DEV, requires_grad=True)

    def loss(x):
        y = (a @ x).to(DEV).sin() @ b
        return y.cpu().square().sum() + y.sum()

    parity(loss, [a, b], lambda s: (torch.randn(8, 8) + s,), backend="inductor", **TOL)


@pytest.mark.inductor
def test_forward_on_a_side_stream_runs_in_eager():
    """NOTE [Streams] (native helper): a graph whose forward ran on another stream than the
    backward's current one runs in eager, as eager syncs the streams; forward and backward both
    on a side stream are compiled."""
    net = _mlp()
    side = torch.cuda.Stream()
    for step in range(2):
        x = torch.randn(16, 64, device=DEV) + step
        side.wait_stream(torch.cuda.current_stream())
        for p in net.parameters():
            p.grad = None
        with torch.cuda.stream(side):
            loss = net(x).pow(2).mean()
        loss.backward()
        torch.cuda.synchronize()
        want = grads_of(net.parameters())
        for p in net.parameters():
            p.grad = None
        with torch.cuda.stream(side):
            loss = net(x).pow(2).mean()
        with ca.enable("inductor"):
            loss.backward()
        torch.cuda.synchronize()
        assert_grads_equal(grads_of(net.parameters()), want, rtol=TOL["rtol"], atol=TOL["atol"])
    s = ca.stats()
    assert s.captures == 0 and s.eager_fallbacks == 2
    assert any("stream" in r for r in s.fallback_reasons), s.fallback_reasons

    ca.reset()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        parity(
            lambda x: net(x).pow(2).mean(),
            net.parameters(),
            lambda s: (torch.randn(16, 64, device=DEV) * (s + 2),),
            backend="inductor",
            **TOL,
        )
    torch.cuda.synchronize()


@pytest.mark.inductor
def test_peak_memory_within_eager_plus_ten_percent():
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.GELU())]).to(DEV)

    def peak(compiled):
        for p in net.parameters():
            p.grad = None
        loss = net(torch.randn(256, 1024, device=DEV)).pow(2).mean()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if compiled:
            with ca.enable("inductor", background=False):
                loss.backward()
        else:
            loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    for _ in range(2):
        peak(True)  # capture + compile, then a hit
    eager = min(peak(False) for _ in range(2))
    ours = min(peak(True) for _ in range(2))
    assert ca.stats().captures == 1
    assert ours <= 1.1 * eager, (ours / 2**20, eager / 2**20)
