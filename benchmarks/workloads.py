"""The benchmark workloads: a model, its inputs and a closure that runs the forward.

Every workload is built from a fixed seed, so every subprocess (one per mode)
sees the same weights and inputs. `Workload.loss()` runs the forward and returns
a scalar loss whose `.backward()` is what gets timed; `Stream` is the
shape-varying case (a list of batches of different sizes through one model).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn


@dataclass
class Workload:
    name: str
    description: str
    params: list  # the leaves whose .grad is compared with eager
    loss: Callable[[], torch.Tensor]  # forward -> scalar loss
    modules: list = field(default_factory=list)
    # what is timed: the backward of loss()'s result (a workload may do more, e.g. create_graph)
    backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward()


@dataclass
class Stream:
    name: str
    description: str
    params: list
    batches: list  # [(input tensor, (batch, seq))]
    loss_of: Callable[[torch.Tensor], torch.Tensor]
    modules: list = field(default_factory=list)


def _mlp(d: int, quick: bool) -> Workload:
    layers, batch = (8, 64) if not quick else (3, 8)
    if quick:
        d = max(16, d // 16)
    net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))])
    x = torch.randn(batch, d)
    return Workload(
        name=f"mlp{d}",
        description=f"{layers} x (Linear({d},{d}) + GELU + LayerNorm), batch {batch}, loss = mean(out^2)",
        params=list(net.parameters()),
        loss=lambda: net(x).pow(2).mean(),
        modules=[net],
    )


def _hooked(quick: bool) -> Workload:
    """The D=1024 MLP with a post-accumulate-grad hook on every parameter, as DDP's reducer
    has one: each `.grad` must be set, and its hook run, at the point eager sets it."""
    wl = _mlp(1024, quick)
    seen = [0]

    def hook(p):
        seen[0] += p.grad.numel()  # reads the .grad just set, keeps no reference to it

    for p in wl.params:
        p.register_post_accumulate_grad_hook(hook)
    wl.description += "; a post-accumulate-grad hook on every parameter (DDP-like: it reads each .grad as it is set)"
    return wl


def _param_hooked(quick: bool) -> Workload:
    """The D=256 MLP with a tensor hook on every parameter that clamps its gradient
    (per-parameter gradient clipping as the backward computes it, the recipe
    `p.register_hook(lambda g: g.clamp(-c, c))`): what each hook returns is what
    AccumulateGrad accumulates, so each runs in the graph, at its eager position."""
    wl = _mlp(256, quick)
    for p in wl.params:
        p.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
    wl.description += "; a tensor hook clamping the gradient on every parameter (per-parameter clipping)"
    return wl


def _module_hooked(quick: bool) -> Workload:
    """The transformer with a logging full backward hook on every Linear and LayerNorm (what
    gradient monitors and per-layer debugging tools register): each hook reads its module's
    grad_output and returns None."""
    wl = _transformer(quick)
    seen = [0]

    def hook(module, grad_input, grad_output):
        seen[0] += grad_output[0].numel()

    n = 0
    for m in wl.modules[0].modules():
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            m.register_full_backward_hook(hook)
            n += 1
    wl.description += f"; a logging full backward hook on each of its {n} Linear and LayerNorm modules"
    return wl


def _offloaded(quick: bool) -> Workload:
    """The transformer with its saved activations compressed to bfloat16 by a saved-tensor
    hook pair (the shape of activation offloading: the packed value lives elsewhere, and
    unpacking brings back a float32 tensor when the node needs it)."""
    wl = _transformer(quick)
    forward = wl.loss

    def pack(t):
        return t.to(torch.bfloat16) if t.is_floating_point() else t

    def unpack(t):
        return t.to(torch.float32) if t.dtype == torch.bfloat16 else t

    def loss():
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return forward()

    wl.loss = loss
    wl.description += "; saved activations packed to bfloat16 by saved_tensors_hooks, unpacked to float32"
    return wl


def _transformer(quick: bool, checkpointed: bool = False) -> Workload:
    if quick:
        layers, d, heads, ff, batch, seq = 1, 32, 2, 64, 2, 8
    else:
        layers, d, heads, ff, batch, seq = 4, 256, 4, 1024, 16, 128
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True),
        layers,
        enable_nested_tensor=False,
    )
    enc.train()
    x = torch.randn(batch, seq, d)

    def loss():
        if not checkpointed:
            return enc(x).pow(2).mean()
        import torch.utils.checkpoint as checkpoint

        h = x
        for layer in enc.layers:
            h = checkpoint.checkpoint(layer, h, use_reentrant=False)
        return h.pow(2).mean()

    return Workload(
        name="transformer",
        description=(
            f"nn.TransformerEncoder: {layers} layers, d_model {d}, {heads} heads, ff {ff}, dropout 0, "
            f"batch_first, batch {batch}, seq {seq}, train mode, loss = mean(out^2)"
            + (" ; each layer under torch.utils.checkpoint (non-reentrant): recomputed in the backward" if checkpointed else "")
        ),
        params=list(enc.parameters()),
        loss=loss,
        modules=[enc],
    )


def _compiled(name: str, quick: bool) -> Workload:
    """A workload whose forward is torch.compile'd (inductor): the whole MLP as one region, or
    each transformer layer as its own region (as a model compiled per block is). Its eager
    backward is AOTAutograd's compiled backward of each region with eager autograd between
    them; compiled autograd inlines each region's backward into one graph. (`Module.compile()`
    compiles nothing here, torch 2.13: no dynamo frame is ever run; `torch.compile(module)` does.)"""
    wl = _mlp(1024, quick) if name == "compiled_mlp1024" else _transformer(quick)
    if name == "compiled_mlp1024":
        net = wl.modules[0]
        region = torch.compile(net)
        x = torch.randn(8 if quick else 64, net[0].in_features, generator=torch.Generator().manual_seed(1))
        wl.loss = lambda: region(x).pow(2).mean()
        wl.description += "; the forward torch.compile'd (inductor) as one region"
    else:
        layers = wl.modules[0].layers
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer)
        wl.description += "; each layer torch.compile'd (inductor): one region per layer"
    return wl


def _cnn(quick: bool) -> Workload:
    blocks, ch = (4, 32) if not quick else (2, 8)
    shape = (16, 3, 64, 64) if not quick else (2, 3, 16, 16)
    mods = []
    for i in range(blocks):
        mods += [nn.Conv2d(3 if i == 0 else ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU()]
    net = nn.Sequential(*mods)
    net.train()
    x = torch.randn(*shape)
    return Workload(
        name="cnn",
        description=(
            f"{blocks} x (Conv2d 3x3 ({ch} channels, padding 1) + BatchNorm2d + ReLU), input "
            f"{'x'.join(map(str, shape))}, train mode, loss = mean(out^2)"
        ),
        params=list(net.parameters()),
        loss=lambda: net(x).pow(2).mean(),
        modules=[net],
    )


def _gradient_penalty(quick: bool) -> Workload:
    """WGAN-GP: the critic's gradient with respect to its input (create_graph=True), then the
    backward of the penalty on its norm plus the critic loss, through that first backward."""
    ch, batch, size = (32, 16, 32) if not quick else (4, 2, 8)
    net = nn.Sequential(
        nn.Conv2d(3, ch, 4, 2, 1),
        nn.LeakyReLU(0.2),
        nn.Conv2d(ch, 2 * ch, 4, 2, 1),
        nn.LeakyReLU(0.2),
        nn.Conv2d(2 * ch, 4 * ch, 4, 2, 1),
        nn.LeakyReLU(0.2),
        nn.Flatten(),
        nn.Linear(4 * ch * (size // 8) ** 2, 1),
    )
    real, fake = torch.randn(batch, 3, size, size), torch.randn(batch, 3, size, size)
    eps = torch.rand(batch, 1, 1, 1)
    x_hat = (eps * real + (1 - eps) * fake).requires_grad_()

    def backward(scores):
        (g,) = torch.autograd.grad(scores.sum(), x_hat, create_graph=True)
        gp = ((g.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
        (10 * gp - scores.mean()).backward()

    return Workload(
        name="gradient_penalty",
        description=(
            f"WGAN-GP critic: 3 x (Conv2d 4x4 stride 2 + LeakyReLU), channels {ch}/{2 * ch}/{4 * ch}, + Linear, "
            f"input {batch}x3x{size}x{size}; timed: grad(scores.sum(), x, create_graph=True), then "
            f"(10 * mean((|grad|_2 - 1)^2) - mean(scores)).backward()"
        ),
        params=list(net.parameters()) + [x_hat],
        loss=lambda: net(x_hat),
        modules=[net],
        backward=backward,
    )


def _chain(quick: bool) -> Workload:
    nodes = 2000 if not quick else 200
    ops = nodes - 2  # + SumBackward0 + AccumulateGrad = `nodes` autograd nodes
    torch.manual_seed(1)
    x = (torch.rand(16) * 0.5 + 0.5).requires_grad_()

    def loss():
        y = x
        for i in range(ops):
            r = i % 3
            if r == 0:
                y = y * 1.0001
            elif r == 1:
                y = y + 0.0001
            else:
                y = torch.sin(y)
        return y.sum()

    return Workload(
        name="chain",
        description=(
            f"a chain of {ops} elementwise ops on a 16-element tensor (x*1.0001, +0.0001, sin, repeated), "
            f"then sum: {nodes} autograd nodes, pure per-node overhead"
        ),
        params=[x],
        loss=loss,
    )


def _stream(quick: bool) -> Stream:
    n, layers, d, heads, ff = (50, 2, 64, 4, 256) if not quick else (6, 1, 32, 2, 64)
    bmax, smax = (32, 128) if not quick else (6, 16)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True),
        layers,
        enable_nested_tensor=False,
    )
    head = nn.Linear(d, d)
    enc.train()
    rng = random.Random(0)
    # Every batch size 2..bmax and sequence length 8..smax (step 8) is equally likely;
    # a fixed list of 50 (batch, seq) pairs in shuffled order.
    shapes = [(rng.randint(2, bmax), rng.randrange(8, smax + 1, 8)) for _ in range(n)]
    rng.shuffle(shapes)
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(b, s, d, generator=gen), (b, s)) for b, s in shapes]
    return Stream(
        name="stream",
        description=(
            f"{n} batches through a TransformerEncoder ({layers} layers, d_model {d}, {heads} heads, ff {ff}, "
            f"dropout 0) + Linear, batch size uniform in 2..{bmax}, sequence length uniform in 8..{smax} "
            f"(step 8), shuffled; {len(set(shapes))} distinct shapes"
        ),
        params=list(enc.parameters()) + list(head.parameters()),
        batches=batches,
        loss_of=lambda x: head(enc(x)).pow(2).mean(),
        modules=[enc, head],
    )


WORKLOADS = [
    "mlp256",
    "mlp1024",
    "transformer",
    "cnn",
    "chain",
    "stream",
    "checkpointed",
    "gradient_penalty",
    "hooked",
    "param_hooked",
    "module_hooked",
    "offloaded",
    "compiled_mlp1024",
    "compiled_transformer",
]


def build(name: str, quick: bool = False):
    wl = _build(name, quick)
    wl.name = name
    return wl


def _build(name: str, quick: bool):
    torch.manual_seed(0)
    if name == "mlp256":
        return _mlp(256, quick)
    if name == "mlp1024":
        return _mlp(1024, quick)
    if name == "transformer":
        return _transformer(quick)
    if name == "checkpointed":
        return _transformer(quick, checkpointed=True)
    if name == "cnn":
        return _cnn(quick)
    if name == "chain":
        return _chain(quick)
    if name == "gradient_penalty":
        return _gradient_penalty(quick)
    if name == "hooked":
        return _hooked(quick)
    if name == "param_hooked":
        return _param_hooked(quick)
    if name == "module_hooked":
        return _module_hooked(quick)
    if name == "offloaded":
        return _offloaded(quick)
    if name == "stream":
        return _stream(quick)
    if name in ("compiled_mlp1024", "compiled_transformer"):
        return _compiled(name, quick)
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


def count_nodes(loss: torch.Tensor) -> int:
    """Autograd nodes reachable from the loss (AccumulateGrad included)."""
    seen = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions)
    return len(seen)
