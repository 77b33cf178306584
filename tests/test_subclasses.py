"""Tensor subclasses in a compiled backward (docs/design/subclasses.md; issue 39). The prototype
of step 1, behind COMPILED_AUTOGRAD_SUBCLASSES (walk/precheck.py: SUBCLASSES): a user's traceable
wrapper subclass, flattened into its inner tensors at collect, traced through its
__torch_dispatch__, rebuilt after the graph."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

import compiled_autograd as ca
from compiled_autograd.walk import precheck


class ScaledTensor(torch.Tensor):
    """A tensor stored as `data * scale` (the scale an inner 0-dim tensor, as FP8 training's
    are): its dispatch unwraps (multiplies out), runs the op, and rewraps with the scale of its
    first ScaledTensor argument."""

    @staticmethod
    def __new__(cls, data, scale, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=requires_grad)

    def __init__(self, data, scale, requires_grad=False):
        self._data = data
        self._scale = scale

    def __tensor_flatten__(self):
        return ["_data", "_scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ScaledTensor(inner["_data"], inner["_scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        scale = None

        def unwrap(t):
            nonlocal scale
            if isinstance(t, ScaledTensor):
                scale = t._scale if scale is None else scale
                return t._data * t._scale
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: ScaledTensor(t / scale, scale) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)


def scaled(t, scale, requires_grad=False):
    s = torch.tensor(scale, dtype=t.dtype)
    return ScaledTensor(t / s, s, requires_grad=requires_grad)


@pytest.fixture
def subclasses(monkeypatch):
    monkeypatch.setattr(precheck, "SUBCLASSES", True)


def _steps(backend, xs, scales=None, grad=False):
    """Per step: a ScaledTensor weight's grad (its inner tensors) after `tanh(x @ w.t()).sum()`'s
    backward, `.grad` accumulated across steps (or `torch.autograd.grad`'s result)."""
    torch.manual_seed(0)
    W = torch.randn(4, 8)
    w = scaled(W, 0.5, requires_grad=True)
    out = []
    for i, x in enumerate(xs):
        if scales is not None:  # a new weight, of a new scale, each step
            w = scaled(W, scales[i], requires_grad=True)
        loss = torch.tanh(x @ w.t()).sum()
        with ca.enable(backend=backend, fullgraph=True) if backend else ca.disable():
            if grad:
                (g,) = torch.autograd.grad(loss, [w])
            else:
                loss.backward()
                g = w.grad
        assert type(g) is ScaledTensor
        out.append((g._data.clone(), g._scale.clone()))
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", ["accumulate", "new_scale", "grad"])
def test_scaled_tensor_compiled(subclasses, backend, case):
    xs = [torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8)]
    kw = {"scales": [0.5, 0.25, 2.0]} if case == "new_scale" else {"grad": True} if case == "grad" else {}
    want = _steps(None, xs, **kw)
    ca.reset()
    got = _steps(backend, xs, **kw)
    for (a, s), (b, t) in zip(want, got):
        assert torch.equal(a, b) and torch.equal(s, t)
    st = ca.stats()
    assert (st.captures, st.hits, st.eager_fallbacks, st.opaque_nodes) == (1, 2, 0, 0)


def test_scaled_tensor_off_falls_back():
    # without the flag: what main does, a whole-backward fallback of kind "tensor subclass"
    xs = [torch.randn(3, 8)]
    assert [torch.equal(a, b) for (a, _), (b, _) in zip(_steps(None, xs), _steps(None, xs))] == [True]
    ca.reset()
    torch.manual_seed(0)
    w = scaled(torch.randn(4, 8), 0.5, requires_grad=True)
    with ca.enable(backend="eager"):
        torch.tanh(xs[0] @ w.t()).sum().backward()
    assert ca.stats().fallback_reasons == {"tensor subclass": 1}


# -- DTensor (docs/design/subclasses.md, step 3 in part): built-in nodes only, no custom Function


@pytest.fixture(params=["gloo1", "fake2"])
def mesh(request, tmp_path):
    """A 1-rank gloo group, or a fake 2-rank one in this process (torch's FakeProcessGroup: its
    collectives do nothing, in eager and in the compiled graph alike, so parity still holds)."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("a process group is already initialized")
    if request.param == "fake2":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        yield init_device_mesh("cpu", (dist.get_world_size(),))
    finally:
        dist.destroy_process_group()


def _dtensor_steps(mesh, backend, layout):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    W1, W2 = torch.randn(16, 8), torch.randn(8, 16)
    p1, p2 = {"colrow": (Shard(0), Shard(1)), "repcol": (Replicate(), Shard(0))}[layout]
    w1 = distribute_tensor(W1, mesh, [p1]).requires_grad_()
    w2 = distribute_tensor(W2, mesh, [p2]).requires_grad_()
    out = []
    for _ in range(3):
        x = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()]).requires_grad_()
        loss = (torch.relu(x @ w1.t()) @ w2.t()).sum()  # a Partial loss: its root grad a DTensor
        with ca.enable(backend=backend, fullgraph=True) if backend else ca.disable():
            loss.backward()
        out.append([(g.placements, g.to_local().clone()) for g in (x.grad, w1.grad, w2.grad)])
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("layout", ["colrow", "repcol"])
def test_dtensor_compiled(subclasses, mesh, backend, layout):
    want = _dtensor_steps(mesh, None, layout)
    ca.reset()
    got = _dtensor_steps(mesh, backend, layout)
    for step_want, step_got in zip(want, got):
        for (pw, a), (pg, b) in zip(step_want, step_got):
            assert pw == pg and torch.equal(a, b)
    st = ca.stats()
    assert (st.captures, st.hits, st.eager_fallbacks, st.opaque_nodes) == (1, 2, 0, 0)
    ops = [str(n.target) for n in ca.graphs()[0].graph.graph.nodes if n.op == "call_function"]
    # DTensor's redistribution of the Partial grad before relu's backward, on 2 ranks: a
    # functional all-reduce in the graph (none on 1 rank, none where the grads stay Partial)
    collective = mesh.size() == 2 and layout == "repcol"
    assert ("_c10d_functional.all_reduce.default" in ops) == collective


# -- a jagged NestedTensor: whole-backward fallback for now, of kind "tensor subclass"


def _njt_steps(scope):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    out = []
    for _ in range(2):
        nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(5, 4)], layout=torch.jagged, requires_grad=True)
        loss = torch.relu(lin(nt)).values().sum()
        with scope():
            loss.backward()
        out.append([nt.grad.values().clone(), lin.weight.grad.clone(), lin.bias.grad.clone()])
    return out


def test_nested_tensor_falls_back_as_a_subclass():
    want = _njt_steps(ca.disable)
    ca.reset()
    got = _njt_steps(lambda: ca.enable(backend="eager"))
    assert all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))
    # (was counted as the user's misuse, and ran in eager under fullgraph=True without a word)
    assert ca.stats().fallback_reasons == {"tensor subclass": 2}
    with pytest.raises(ca.CompiledAutogradError, match="nested tensor"):
        _njt_steps(lambda: ca.enable(backend="eager", fullgraph=True))
