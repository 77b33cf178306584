"""Single ops, compiled vs eager, two different inputs through one cache entry."""

import pytest
import torch
import torch.nn.functional as F

import compiled_autograd as ca

from helpers import parity

R = torch.randn


def leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


# name -> (shapes of the leaves, loss function of the leaves)
OPS = {
    # reductions with dim / keepdim
    "sum": ([(3, 4)], lambda x: x.sum()),
    "sum_dim": ([(3, 4, 5)], lambda x: x.sum(1).pow(2).sum()),
    "sum_dim_keepdim": ([(3, 4, 5)], lambda x: (x.sum((0, 2), keepdim=True) * R(1, 4, 1)).sum()),
    "sum_neg_dim": ([(3, 4)], lambda x: x.sum(-1).pow(2).sum()),
    "mean_dim": ([(3, 4)], lambda x: x.mean(0).pow(2).sum()),
    "amax": ([(3, 4)], lambda x: x.amax(1).sum()),
    "max_dim": ([(3, 4)], lambda x: x.max(1).values.sum()),
    "logsumexp": ([(3, 4)], lambda x: x.logsumexp(-1).sum()),
    "var": ([(5, 4)], lambda x: x.var(0, correction=1).sum()),
    "norm": ([(3, 4)], lambda x: x.norm(dim=1).sum()),
    "prod": ([(3, 4)], lambda x: x.prod(1).sum()),
    "cumsum": ([(3, 4)], lambda x: x.cumsum(1).pow(2).sum()),
    # views and reshapes
    "view": ([(4, 6)], lambda x: x.view(2, 12).pow(2).sum()),
    "reshape_noncontig": ([(4, 6)], lambda x: x.t().reshape(-1).pow(2).sum()),
    "permute": ([(2, 3, 4)], lambda x: (x.permute(2, 0, 1) * R(4, 2, 3)).sum()),
    "transpose": ([(2, 3, 4)], lambda x: (x.transpose(0, 2) * R(4, 3, 2)).sum()),
    "squeeze_unsqueeze": ([(3, 1, 4)], lambda x: (x.squeeze(1).unsqueeze(0) * R(1, 3, 4)).sum()),
    "expand": ([(3, 1)], lambda x: (x.expand(3, 5) * R(3, 5)).sum()),
    "flatten_unflatten": ([(2, 3, 4)], lambda x: x.flatten(1).unflatten(1, (4, 3)).pow(2).sum()),
    "diagonal": ([(4, 4)], lambda x: x.diagonal().pow(2).sum()),
    "as_strided": ([(4, 4)], lambda x: x.as_strided((2, 2), (1, 4), 1).pow(2).sum()),
    "unfold": ([(10,)], lambda x: x.unfold(0, 3, 2).pow(2).sum()),
    # indexing, slicing, gather, scatter
    "slice": ([(6, 4)], lambda x: x[1:5:2, 1:].pow(2).sum()),
    "select": ([(6, 4)], lambda x: x[2].pow(2).sum()),
    "index_tensor": ([(6, 4)], lambda x: x[torch.tensor([0, 2, 2, 5])].pow(2).sum()),
    "index_bool": ([(6, 4)], lambda x: x[torch.tensor([True, False, True, True, False, False])].pow(2).sum()),
    "index_select": ([(6, 4)], lambda x: x.index_select(1, torch.tensor([3, 0])).pow(2).sum()),
    "gather": ([(3, 4)], lambda x: x.gather(1, torch.tensor([[0, 1], [2, 3], [1, 1]])).pow(2).sum()),
    "scatter": ([(3, 4), (3, 2)], lambda x, s: x.scatter(1, torch.tensor([[0, 1], [2, 3], [1, 0]]), s).pow(2).sum()),
    "scatter_add": ([(3, 4), (3, 2)], lambda x, s: x.scatter_add(1, torch.tensor([[0, 0], [2, 3], [1, 1]]), s).pow(2).sum()),
    "index_put": ([(5, 3), (2, 3)], lambda x, v: x.index_put((torch.tensor([1, 3]),), v).pow(2).sum()),
    "masked_fill": ([(3, 4)], lambda x: x.masked_fill(torch.tensor([True, False, True, False]), 0.5).pow(2).sum()),
    "where": ([(3, 4), (3, 4)], lambda x, y: torch.where(x.detach() > 0, x, y).pow(2).sum()),
    # cat, stack, split
    "cat": ([(2, 3), (2, 5)], lambda a, b: torch.cat([a, R(2, 2), b], 1).pow(2).sum()),
    "stack": ([(2, 3), (2, 3)], lambda a, b: torch.stack([a, b], 1).pow(2).sum()),
    "split": ([(6, 4)], lambda x: sum((i + 1) * p.pow(2).sum() for i, p in enumerate(x.split(2)))),
    "split_unused": ([(6, 4)], lambda x: x.split([1, 2, 3])[1].pow(2).sum()),
    "chunk": ([(6, 6)], lambda x: x.chunk(3, 1)[0].sum() + x.chunk(3, 1)[2].pow(2).sum()),
    "unbind": ([(3, 4)], lambda x: sum(r.pow(i + 1).sum() for i, r in enumerate(x.unbind(0)))),
    # broadcasting binary ops
    "add_broadcast": ([(3, 1), (1, 4)], lambda a, b: (a + b).pow(2).sum()),
    "sub_alpha": ([(3, 4), (4,)], lambda a, b: torch.sub(a, b, alpha=2.5).pow(2).sum()),
    "mul_broadcast": ([(2, 3, 4), (3, 1)], lambda a, b: (a * b).pow(2).sum()),
    "div": ([(3, 4), (3, 4)], lambda a, b: (a / (b.abs() + 1)).sum()),
    "pow_tensor": ([(3, 4), (3, 4)], lambda a, b: (a.abs() + 0.5).pow(b).sum()),
    "maximum": ([(3, 4), (3, 4)], lambda a, b: torch.maximum(a, b).pow(2).sum()),
    "addcmul": ([(3, 4), (3, 4), (3, 4)], lambda a, b, c: torch.addcmul(a, b, c, value=0.5).pow(2).sum()),
    "scalar_mul": ([(3, 4)], lambda x: (x * 2.0 + 1.0).pow(2).sum()),
    "lerp": ([(3, 4), (3, 4)], lambda a, b: torch.lerp(a, b, 0.3).pow(2).sum()),
    "clamp": ([(3, 4)], lambda x: x.clamp(-0.5, 0.5).pow(2).sum()),
    # matmul family
    "mm": ([(3, 4), (4, 5)], lambda a, b: (a @ b).pow(2).sum()),
    "matmul_3d_2d": ([(2, 3, 4), (4, 5)], lambda a, b: (a @ b).pow(2).sum()),
    "bmm": ([(2, 3, 4), (2, 4, 5)], lambda a, b: torch.bmm(a, b).pow(2).sum()),
    "einsum": ([(2, 3, 4), (4, 5)], lambda a, b: torch.einsum("bij,jk->bik", a, b).pow(2).sum()),
    "addmm": ([(5,), (3, 4), (4, 5)], lambda c, a, b: torch.addmm(c, a, b).pow(2).sum()),
    "linear": ([(3, 4), (5, 4), (5,)], lambda x, w, b: F.linear(x, w, b).pow(2).sum()),
    "mv": ([(3, 4), (4,)], lambda a, v: (a @ v).pow(2).sum()),
    "outer": ([(3,), (4,)], lambda a, b: torch.outer(a, b).pow(2).sum()),
    "baddbmm": ([(2, 3, 5), (2, 3, 4), (2, 4, 5)], lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5).pow(2).sum()),
    # softmax family and losses
    "softmax": ([(3, 5)], lambda x: (x.softmax(-1) * R(3, 5)).sum()),
    "softmax_dim0": ([(3, 5)], lambda x: (x.softmax(0) * R(3, 5)).sum()),
    "log_softmax": ([(3, 5)], lambda x: (x.log_softmax(1) * R(3, 5)).sum()),
    "cross_entropy": ([(4, 6)], lambda x: F.cross_entropy(x, torch.randint(0, 6, (4,)))),
    "cross_entropy_smoothing": ([(4, 6)], lambda x: F.cross_entropy(x, torch.randint(0, 6, (4,)), label_smoothing=0.1)),
    "nll_loss_ignore": ([(4, 6)], lambda x: F.nll_loss(x.log_softmax(1), torch.tensor([1, -100, 3, 0]))),
    "mse_loss": ([(3, 4)], lambda x: F.mse_loss(x, R(3, 4))),
    "bce_logits": ([(3, 4)], lambda x: F.binary_cross_entropy_with_logits(x, torch.rand(3, 4))),
    "smooth_l1": ([(3, 4)], lambda x: F.smooth_l1_loss(x, R(3, 4), beta=0.5)),
    # dtype casts
    "to_float64": ([(3, 4)], lambda x: x.to(torch.float64).pow(2).sum().float()),
    "to_float16_and_back": ([(3, 4)], lambda x: x.half().float().pow(2).sum()),
    "to_bfloat16": ([(3, 4)], lambda x: (x.bfloat16() * 2).float().sum()),
    "float64_leaf_mixed": ([(3, 4)], lambda x: (x * torch.ones(3, 4, dtype=torch.float64)).sum()),
    "type_as": ([(3, 4)], lambda x: x.type_as(torch.zeros((), dtype=torch.float64)).exp().sum()),
    # activations and normalisation
    "gelu_tanh": ([(3, 4)], lambda x: F.gelu(x, approximate="tanh").sum()),
    "leaky_relu": ([(3, 4)], lambda x: F.leaky_relu(x, 0.2).pow(2).sum()),
    "silu": ([(3, 4)], lambda x: F.silu(x).pow(2).sum()),
    "layer_norm": ([(3, 4), (4,), (4,)], lambda x, w, b: F.layer_norm(x, (4,), w, b).pow(3).sum()),
    "group_norm": ([(2, 4, 3), (4,), (4,)], lambda x, w, b: F.group_norm(x, 2, w, b).pow(3).sum()),
    "rms_norm": ([(3, 4), (4,)], lambda x, w: F.rms_norm(x, (4,), w).pow(3).sum()),
    "embedding_padding": ([(10, 3)], lambda w: F.embedding(torch.tensor([[1, 0, 4], [0, 9, 1]]), w, padding_idx=0).pow(2).sum()),
    "conv1d_stride": ([(2, 3, 10), (4, 3, 3)], lambda x, w: F.conv1d(x, w, stride=2, padding=1).pow(2).sum()),
    "conv_transpose2d": ([(1, 2, 5, 5), (2, 3, 3, 3)], lambda x, w: F.conv_transpose2d(x, w, stride=2).pow(2).sum()),
    "max_pool2d": ([(1, 2, 6, 6)], lambda x: F.max_pool2d(x, 2).pow(2).sum()),
    "avg_pool2d": ([(1, 2, 6, 6)], lambda x: F.avg_pool2d(x, 3, stride=2, padding=1).pow(2).sum()),
    "interpolate_bilinear": ([(1, 2, 4, 4)], lambda x: F.interpolate(x, scale_factor=2, mode="bilinear").pow(2).sum()),
    "pad_reflect": ([(1, 2, 5)], lambda x: F.pad(x, (2, 1), mode="reflect").pow(2).sum()),
    "sdpa": (
        [(2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 8)],
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).sum(),
    ),
    # the same tensor used as several inputs
    "same_tensor_twice": ([(3, 3)], lambda x: (x @ x + x * x).sum()),
    "output_not_requiring_grad": ([(3, 4)], lambda x: x.pow(2).sum() + (x.detach() * 2).sum()),
}


# the backends that run eager's kernels in eager's order are bitwise eager's (prod's formula,
# which takes another path when traced, runs opaquely: NOTE [Formulas that take another path
# when traced], nodes/builtin.py)
RUN_OPAQUELY = {"prod"}


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_parity(name):
    shapes, fn = OPS[name]
    leaves = [leaf(*s) for s in shapes]
    bases = [t.detach().clone() for t in leaves]

    def make_inputs(step):
        # new values each step; R() inside fn draws from the per-step seed
        with torch.no_grad():
            for t, b in zip(leaves, bases):
                t.copy_(b + step * 0.37 + torch.randn_like(b) * 0.1)
        return ()

    if name in RUN_OPAQUELY:  # its first backward learns the opaque node's output layout
        parity(lambda: fn(*leaves), leaves, make_inputs, backend="eager", steps=3, captures=None)
        s = ca.stats()
        assert (s.learning_backwards, s.captures, s.hits, s.opaque_nodes, s.eager_fallbacks) == (1, 1, 1, 2, 0), s
        return
    parity(lambda: fn(*leaves), leaves, make_inputs, backend="eager")


@pytest.mark.parametrize("name", ["cat", "index_put", "softmax", "sdpa", "conv1d_stride", "split_unused"])
def test_op_parity_aot_eager(name):
    shapes, fn = OPS[name]
    leaves = [leaf(*s) for s in shapes]
    parity(lambda: fn(*leaves), leaves, lambda s: (), backend="aot_eager")
