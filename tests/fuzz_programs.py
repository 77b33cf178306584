"""Random autograd programs, for differential testing against eager (tests/test_fuzz.py).

A program is a seed: it builds leaves and a list of ops over a growing pool of tensors
(elementwise, broadcasting, matmul, reductions, views, in-place updates of views, indexing,
casts, complex views, multi-output ops with unused outputs, dropout, batch norm, custom
Functions (non-differentiable outputs, mark_dirty, once_differentiable, tensors read from a
global or a closure), tensor, node and
post-accumulate hooks, retain_grad, a saved tensor changed in place (eager raises),
torch.compile'd regions), then sums the pool into a loss; some forwards run under CPU
autocast to bfloat16. Leaves may have hooks and a .grad before the backward. The same seed
with the same batch size builds the same graph structure; values come from `values_seed`,
so two calls with different value seeds go through one cache entry.
"""

from __future__ import annotations

import random

import torch


import torch.nn.functional as F


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


class SplitSign(torch.autograd.Function):
    """Two outputs, the second non-differentiable; grads not materialized (a None comes in)."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        sign = (x > 0).to(x.dtype)
        ctx.mark_non_differentiable(sign)
        return x.abs(), sign

    @staticmethod
    def backward(ctx, g, _gsign):
        if g is None:
            return None
        (x,) = ctx.saved_tensors
        return g * x.sign()


class MulInPlace(torch.autograd.Function):
    """Modifies its input in place (mark_dirty) and saves its output."""

    @staticmethod
    def forward(ctx, x, k: float):
        ctx.k = k
        x.mul_(k).exp_()
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out * ctx.k, None


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * g * x * x


_GAIN = torch.tensor([1.25])  # read by GlobalGain's backward: a graph input, not a constant


class GlobalGain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * _GAIN + 1


def _closure_gain(gain):
    class ClosureGain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.sin()

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x.cos() * gain

    return ClosureGain


ClosureGain = _closure_gain(torch.tensor(0.75))


def _quarter_grad(p):
    p.grad.mul_(0.25)


def build(seed: int, batch: int, values_seed: int, dtype=torch.float32):
    """(leaves, loss_fn, retained, init_grads): loss_fn() runs the forward and returns the loss;
    `retained` lists the intermediates whose .grad is kept (retain_grad), filled by each
    loss_fn() call; init_grads() sets the leaves' .grad as they are before the backward."""
    rng = random.Random(seed)
    d = rng.choice([3, 4, 6])
    gen = torch.Generator().manual_seed(values_seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    leaves = [rand(batch, d).requires_grad_(), rand(d, d).requires_grad_(), rand(d).requires_grad_()]
    if rng.random() < 0.5:
        leaves.append(rand(batch, d).requires_grad_(rng.random() < 0.8))
    consts = [rand(batch, d), (rand(batch, d) > 0), torch.zeros(d), torch.ones(d)]  # + batch norm's running stats
    # hooks on leaves live as long as the leaves: registered once here, not per forward
    if rng.random() < 0.2:
        leaves[1].register_hook(lambda g: g * 0.5)
    if rng.random() < 0.15:
        h = leaves[0].register_hook(lambda g: g * 100)
        h.remove()
    if rng.random() < 0.2:
        leaves[2].register_post_accumulate_grad_hook(_quarter_grad)
    # grads that exist before the backward: accumulated into (one transposed: strides kept);
    # which ones changes with the values (a hit must handle a .grad that is there or not)
    init = []
    if rng.random() < 0.3:
        init = [(i, rng.random() < 0.5) for i in range(len(leaves)) if rng.random() < 0.6]
    init_values = {
        i: rand(*leaves[i].shape[::-1]).t() if t and leaves[i].dim() == 2 else rand(*leaves[i].shape)
        for i, t in init
        if (values_seed + i) % 3
    }

    def init_grads():
        for i, t in enumerate(leaves):
            t.grad = init_values[i].clone().as_strided(init_values[i].shape, init_values[i].stride()) if i in init_values else None

    n_ops = rng.randint(3, 14)
    plan = [(rng.randrange(1 << 30), rng.random()) for _ in range(n_ops)]
    autocast = rng.random() < 0.15  # the forward under CPU autocast to bfloat16
    retained: list = []

    def loss_fn():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return forward()

    def forward():
        r = random.Random(seed * 7 + 1)
        torch.manual_seed(values_seed)  # dropout's masks: the same in eager's forward and ours
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

    loss_fn.autocast = autocast
    return leaves, loss_fn, retained, init_grads


N_KINDS = 78


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
    elif kind == 39:
        y = (a.norm(dim=-1, keepdim=True) + 1).reciprocal() * b
    else:
        y = _op2(kind, o, a, b, d, leaves, consts, retained)
    return y


def _op2(kind, o, a, b, d, leaves, consts, retained):
    n = a.shape[0]
    if kind == 40:  # a multi-output node with an unused output (an undefined grad)
        y = a.split([1, a.shape[1] - 1], 1)[o.randrange(2)].sum(1, keepdim=True) * b
    elif kind == 41:
        v, i = a.max(1, keepdim=True)
        y = v * b + a.gather(1, i.flip(0))
    elif kind == 42:
        y = a.sort(dim=o.randrange(2))[0] * b
    elif kind == 43:
        y = a.topk(2, dim=1).values.sum(1, keepdim=True) * b
    elif kind == 44:
        v, m = torch.var_mean(a, dim=0, keepdim=True)
        y = v + m * b
    elif kind == 45:
        y = F.gelu(a) * F.silu(b)
    elif kind == 46:
        y = F.linear(a, leaves[1], leaves[2])
    elif kind == 47:
        y = F.conv1d(a.unsqueeze(1), leaves[1][:2, :3].reshape(2, 1, 3), padding=1).sum(1) * b
    elif kind == 48:
        y = F.dropout(a, 0.3, training=True) * b
    elif kind == 49:
        m, sign = SplitSign.apply(a)
        y = (m if o.random() < 0.7 else a * 1) * sign + b
    elif kind == 50:
        y = MulInPlace.apply(a.clone(), o.choice([0.5, -0.3])) * b
    elif kind == 51:
        r = o.random()
        y = (Cube.apply(a) if r < 0.6 else GlobalGain.apply(a) if r < 0.8 else ClosureGain.apply(a)) + b
    elif kind == 52:  # node hooks on an intermediate
        y = a * b + 1
        if y.grad_fn is not None:
            if o.random() < 0.5:
                y.grad_fn.register_prehook(lambda gO: (gO[0] * 3,))
            else:
                y.grad_fn.register_hook(lambda gI, gO: tuple(None if g is None else g * 0.5 for g in gI))
    elif kind == 53:  # a hook removed before the backward; a hook that returns None
        y = a.exp().clamp(max=20)
        if y.requires_grad:
            y.register_hook(lambda g: g * 1000).remove()
            y.register_hook(lambda g: None)
    elif kind == 54:
        y = F.embedding(torch.arange(n) % d, leaves[1]) * a
    elif kind == 55:
        y = F.cross_entropy(a, torch.arange(n) % a.shape[1]) * b
    elif kind == 56:
        c = torch.view_as_complex(a.reshape(-1, 2))
        y = torch.view_as_real(c * c.conj() + c * 1j).reshape(a.shape) + b
    elif kind == 57:
        y = torch.where(a > 0, a, a * 0.1) + F.leaky_relu(b, 0.2)
    elif kind == 58:
        y = a.clamp(-0.5, 0.5) * b + a.abs().add(1).sqrt()
    elif kind == 59:
        y = torch.einsum("bi,ij->bj", a, leaves[1])
    elif kind == 60:
        y = a.repeat(1, 2)[:, ::2] * b
    elif kind == 61:  # batch norm updating running stats in place in the forward
        y = F.batch_norm(a, consts[2], consts[3], leaves[2], None, training=True) + b
    elif kind == 62:
        y = Scale.apply(a, b, 1.5) if o.random() < 0.5 else a.index_add(0, torch.zeros(n, dtype=torch.long), b)
    elif kind == 63:
        y = a.scatter(1, torch.zeros(n, 1, dtype=torch.long), b[:, :1] * 2)
    elif kind == 64:
        y = a.abs().add(1).pow(b.tanh())
    elif kind == 65:
        y = torch.lerp(a, b, 0.3) + torch.addcmul(a, a, b, value=0.5)
    elif kind == 66:  # in-place through a view of a view
        y = a.clone()
        w = y[1:][:, 1:]
        w.mul_(b[1:, 1:] if b.shape == a.shape else 2.0)
    elif kind == 67:
        y = a.clone()
        y.t_()
        y = y.t() * b
    elif kind == 68:
        g = torch.Generator().manual_seed(o.randrange(1000))
        perm = torch.randperm(a.numel(), generator=g)
        y = a.reshape(-1)[perm].reshape(a.shape) * b
    elif kind == 69:
        y = torch.diag_embed(a).sum(-1) + a.new_ones(()) * b
    elif kind == 70:
        y = F.group_norm(a.unsqueeze(-1), 1).squeeze(-1) * b if a.dim() == 2 else a * b
    elif kind == 71:
        y = a.clone()
        y.detach_()
        y = y * b + a.std(dim=0, keepdim=True)
    elif kind == 72:  # misuse, sometimes: a saved tensor changed in place (eager's backward raises)
        y = a.clone()
        z = y.sin()  # (saves its input)
        if o.random() < 0.3:
            y.mul_(2)
        y = z * b
    elif kind == 73:  # a leaf's view used, and a leaf's value read through .data
        y = leaves[1][: a.shape[1], :1].t() * a + leaves[2].data * b
    else:  # a torch.compile'd region: its backward is inlined into ours (NOTE [Inlining AOTAutograd backwards])
        y = _region(kind - 74)(a, b, leaves[1])
    return y


def _region(i):
    return _REGIONS[i]


def _compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


@_compiled
def _region_elementwise(a, b, w):
    return (a.sin() * b).cos() + a.sum(1, keepdim=True)


@_compiled
def _region_views(a, b, w):
    u = a * b
    return u[:, :2].sum(1, keepdim=True) + u.t().t() * 0.5


@_compiled
def _region_in_place(a, b, w):
    t = a.clone()
    t[:, 0] *= b[:, 0]
    return t.relu() + F.dropout(b, 0.25, training=True)


@_compiled
def _region_matmul(a, b, w):
    return F.layer_norm(a @ w, w.shape[-1:]) * b


_REGIONS = [_region_elementwise, _region_views, _region_in_place, _region_matmul]
