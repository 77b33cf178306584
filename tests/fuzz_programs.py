"""Random autograd programs, for differential testing against eager (tests/test_fuzz.py).

A program is a seed: it builds leaves and a list of ops over a growing pool of tensors
(elementwise, broadcasting, matmul, reductions, views, in-place updates of views, indexing,
casts, a custom Function, tensor hooks, retain_grad), then sums the pool into a loss. The
same seed with the same batch size builds the same graph structure; values come from
`values_seed`, so two calls with different value seeds go through one cache entry.
"""

from __future__ import annotations

import random

import torch


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, k: float):
        ctx.k = k
        ctx.save_for_backward(x, w)
        return x * w * k

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w * ctx.k, (g * x * ctx.k).sum_to_size(w.shape), None


def build(seed: int, batch: int, values_seed: int, dtype=torch.float32):
    """(leaves, loss_fn, retained): loss_fn() runs the forward and returns the loss; `retained`
    lists the intermediates whose .grad is kept (retain_grad), filled by each loss_fn() call."""
    rng = random.Random(seed)
    d = rng.choice([3, 4, 6])
    gen = torch.Generator().manual_seed(values_seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    leaves = [rand(batch, d).requires_grad_(), rand(d, d).requires_grad_(), rand(d).requires_grad_()]
    if rng.random() < 0.5:
        leaves.append(rand(batch, d).requires_grad_(rng.random() < 0.8))
    consts = [rand(batch, d), (rand(batch, d) > 0)]
    n_ops = rng.randint(3, 14)
    plan = [(rng.randrange(1 << 30), rng.random()) for _ in range(n_ops)]
    retained: list = []

    def loss_fn():
        r = random.Random(seed * 7 + 1)
        pool = [leaves[0], leaves[0] @ leaves[1] + leaves[2]] + leaves[3:]
        retained.clear()
        for op_seed, _ in plan:
            o = random.Random(op_seed)
            a = pool[o.randrange(len(pool))]
            b = pool[o.randrange(len(pool))]
            kind = o.randrange(N_KINDS)
            try:
                y = _op(kind, o, a, b, d, leaves, consts, retained)
            except RuntimeError:  # shapes that do not fit: the same at every batch size
                continue
            pool.append(y)
        loss = sum((t * (i + 1)).sum() for i, t in enumerate(pool) if t.requires_grad)
        return loss * r.choice([1.0, 0.1])

    return leaves, loss_fn, retained


N_KINDS = 40


def _op(kind, o, a, b, d, leaves, consts, retained):
    if kind == 0:
        y = a.sin()
    elif kind == 1:
        y = torch.tanh(a) * b
    elif kind == 2:
        y = a + b * 0.5
    elif kind == 3:
        y = a / (b.abs() + 1)
    elif kind == 4:
        y = torch.maximum(a, b)
    elif kind == 5:
        y = torch.where(consts[1], a, b)
    elif kind == 6:
        y = a @ leaves[1]
    elif kind == 7:
        y = a - a.sum(dim=o.randrange(2), keepdim=True) / 3
    elif kind == 8:
        y = a.softmax(dim=o.randrange(2)) * b
    elif kind == 9:
        y = a.logsumexp(dim=1, keepdim=True) + b
    elif kind == 10:
        y = a.cumsum(dim=o.randrange(2))
    elif kind == 11:
        y = a.t().contiguous().t() * 2 + a.flip(0)
    elif kind == 12:
        k = o.randrange(1, d)
        y = torch.cat([a[:, :k] * 3, a[:, k:]], dim=1)
    elif kind == 13:
        y = a.unsqueeze(0).expand(2, *a.shape).sum(0)
    elif kind == 14:  # in-place on a view of a clone (CopySlices)
        y = a.clone()
        y[:, o.randrange(d)] *= 2
    elif kind == 15:
        y = a.clone()
        y.add_(b).relu_()
    elif kind == 16:
        y = a.clone()
        y.view(-1)[:: o.choice([2, 3])].mul_(0.5)
    elif kind == 17:
        idx = torch.tensor([o.randrange(d) for _ in range(2)])
        y = a.index_select(1, idx).sum(1, keepdim=True) * b
    elif kind == 18:
        y = a.masked_fill(consts[1], 0.0) + b.gather(1, torch.zeros(a.shape[0], 1, dtype=torch.long))
    elif kind == 19:
        y = (a.double() * 1.5).to(a.dtype)
    elif kind == 20:
        y = Scale.apply(a, leaves[2], o.choice([0.5, 2.0]))
    elif kind == 21:
        y = a * 1.0
        if y.requires_grad:
            y.register_hook(lambda g: g * 1.5)
    elif kind == 22:
        y = a * b
        if y.requires_grad:
            y.retain_grad()
            retained.append(y)
    elif kind == 23:
        y = (a * consts[0]).pow(2).mean(dim=0, keepdim=True) + b
    elif kind == 24:  # a view of the input, then the base changed in place (the view's grad_fn is regenerated)
        base = a.clone()
        v = base[1:]
        base.mul_(2)
        y = v * b[1:] if b.shape == a.shape else v.sum() * b
    elif kind == 25:
        y = torch.stack(a.unbind(0)[::-1], 0) + b
    elif kind == 26:
        c1, c2 = a.chunk(2, dim=1)
        y = torch.cat([c2, c1 * 0.5], dim=1)
    elif kind == 27:
        y = a.clone()
        y.unsqueeze_(0)
        y.transpose_(0, 1)
        y = y.squeeze(1) + b
    elif kind == 28:
        n = min(a.shape)
        y = a[:n, :n].diagonal().unsqueeze(0) * b if n > 1 else a * b
    elif kind == 29:
        y = a.as_strided((2, 2), (1, 2)).sum() * b
    elif kind == 30:
        y = torch.zeros_like(a).index_put((torch.tensor([0, 0]), torch.tensor([0, 1])), b[0, :2], accumulate=True) + a
    elif kind == 31:
        y = torch.zeros_like(a).scatter_add(1, torch.zeros_like(a, dtype=torch.long), a * b)
    elif kind == 32:
        with torch.no_grad():
            c = a * 2
        y = c * b + a.detach() * a
    elif kind == 33:
        y = torch.utils.checkpoint.checkpoint(lambda u, v: (u.sin() * v).cos(), a, b, use_reentrant=False)
    elif kind == 34:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t):
            y = a.exp().clamp(max=1e3) * b
    elif kind == 35:
        y = a.unfold(1, 2, 1).sum(-1)
    elif kind == 36:
        y = a.to(torch.float64) + b.to(torch.float64).mean()
    elif kind == 37:
        y = torch.nn.functional.layer_norm(a, a.shape[-1:]) * b
    elif kind == 38:
        y = a.clone()
        y[consts[1][: y.shape[0], : y.shape[1]]] = 0.0 if y.shape == consts[1].shape else y[0, 0]
    else:
        y = (a.norm(dim=-1, keepdim=True) + 1).reciprocal() * b
    return y
