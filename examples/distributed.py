"""Distributed training with a compiled backward: DDP, FSDP2, tensor parallel (TP) or FSDP2 + TP,
launched with torchrun.

    torchrun --nproc-per-node 2 examples/distributed.py --wrap ddp
    torchrun --nproc-per-node 2 examples/distributed.py --wrap fsdp2 --bf16 --check
    torchrun --nproc-per-node 4 examples/distributed.py --wrap ddp --static-graph --timeline
    torchrun --nproc-per-node 2 examples/distributed.py --wrap tp --sequence-parallel --check --timeline
    torchrun --nproc-per-node 4 examples/distributed.py --wrap fsdp2+tp --check

Each rank trains a small transformer on synthetic batches (its own; under TP, its TP group's);
the backward runs under `compiled_autograd.enable(BACKEND)`. DDP's bucket allreduces and FSDP2's
all-gathers and reduce-scatters are started by their hooks from inside the compiled graph, as in
eager. Under TP the parameters are DTensors: their collectives (the all-reduces of rowwise
layers' input grads, sequence parallelism's all-gathers and reduce-scatters) are functional
collectives inside the compiled graph, where DTensor issues them in eager. fsdp2+tp shards a
(world/2, 2) mesh: FSDP2 on its first dim, TP on its second.

--check     also trains an eager copy side by side; grads and parameters compared bitwise
            (use --backend aot_eager or eager: inductor's fused kernels round differently)
--timeline  DDP, FSDP2: when each gradient collective was launched, as a fraction of its
            backward (those before 100% overlap the rest of it); TP: the collectives eager's
            backward issued and those of the compiled graph, in order, each at its position
            among the backward's ops
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import compiled_autograd as ca


class Model(nn.Module):
    def __init__(self, d=64, heads=4, layers=4, ff=128, classes=8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1))


class Attention(nn.Module):
    """Causal self-attention written for tensor parallelism: q, k and v colwise, the output
    projection rowwise; `view(b, s, -1, hd)` takes the heads this rank holds."""

    def __init__(self, d, heads):
        super().__init__()
        self.hd = d // heads
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.wo = nn.Linear(d, d)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        return self.w2(nn.functional.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.ffn = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), FeedForward(d, ff)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TPModel(nn.Module):
    """A small decoder (pre-norm blocks, a vocabulary head) for --wrap tp and fsdp2+tp: its
    input is a sequence of d-vectors, its output per-position logits."""

    def __init__(self, d=64, heads=4, layers=2, ff=128, vocab=32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def parallelize(model, mesh, sequence_parallel=False, loss_parallel=False):
    """Megatron-style tensor parallelism over `mesh` (1-D): attention and feed-forward colwise
    then rowwise; with `sequence_parallel`, the LayerNorms and the residual stream sharded on
    the sequence (the input is then this rank's slice of the sequence); with `loss_parallel`,
    the logits stay sharded on the vocabulary for `loss_parallel()`'s cross entropy."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module

    sp = sequence_parallel
    plan = {f"{m}.{w}": ColwiseParallel() for m, w in (("attn", "wq"), ("attn", "wk"), ("attn", "wv"), ("ffn", "w1"))}
    rowwise = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    plan |= {"attn.wo": RowwiseParallel(**rowwise), "ffn.w2": RowwiseParallel(**rowwise)}
    if sp:
        plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel()}
        plan |= {m: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)) for m in ("attn", "ffn")}
    for b in model.blocks:
        parallelize_module(b, mesh, plan)
    head = dict(input_layouts=Shard(1) if sp else Replicate())
    head |= dict(output_layouts=Shard(-1), use_local_output=False) if loss_parallel else dict(output_layouts=Replicate())
    top = {"head": ColwiseParallel(**head)}
    if sp:
        top |= {"blocks.0": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),)), "norm": SequenceParallel()}
    return parallelize_module(model, mesh, top)


def wrap(model, args):
    if args.wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, static_graph=args.static_graph, gradient_as_bucket_view=args.bucket_view, bucket_cap_mb=args.bucket_mb)
        if args.timeline:
            ddp.register_comm_hook(None, _timed_allreduce)
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if args.bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, reshard_after_forward=not args.no_reshard)
    return fully_shard(model, mp_policy=mp, reshard_after_forward=not args.no_reshard)


# --timeline: launch times of gradient collectives, in perf_counter seconds
LAUNCHES: list[float] = []


def _timed_allreduce(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    LAUNCHES.append(time.perf_counter())
    return default_hooks.allreduce_hook(state, bucket)


def _time_reduce_scatters():
    """FSDP2 reduces gradients with one reduce-scatter per parameter group, from its
    post-backward hooks (torch.distributed's reduce_scatter_single from torch 2.13)."""
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, lambda *a, _original=original, **k: (LAUNCHES.append(time.perf_counter()), _original(*a, **k))[1])


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


COLLECTIVES = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"}


class EagerCollectives(torch.utils._python_dispatch.TorchDispatchMode):
    """--timeline under TP: the functional collectives an eager backward issues, each with its
    position among the backward's ops. DTensor ops are let through to DTensor's dispatch
    (NotImplemented), whose ops on local tensors come back here."""

    def __init__(self):
        super().__init__()
        self.ops, self.collectives = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        if func.namespace == "_c10d_functional" and func._opname in COLLECTIVES:
            self.collectives.append((func._opname, tuple(args[0].shape), self.ops))
        self.ops += 1
        return func(*args, **(kwargs or {}))


def graph_collectives(gm):
    """The functional collectives of a compiled backward's graph, in its order, each with its
    position among the graph's ops."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    return [
        (n.target._opname, tuple(n.args[0].meta["val"].shape), i)
        for i, n in enumerate(nodes)
        if getattr(n.target, "namespace", None) == "_c10d_functional" and n.target._opname in COLLECTIVES
    ], len(nodes)


def build(args, world):
    """The model of --wrap, wrapped; and the TP mesh (None without TP)."""
    torch.manual_seed(0)
    if args.wrap in ("ddp", "fsdp2"):
        return wrap(checkpointed(Model(), args), args), None
    from torch.distributed.device_mesh import init_device_mesh

    model = TPModel()
    if args.wrap == "fsdp2+tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
    else:
        mesh = tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize(model, tp, sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel)
    checkpointed(model, args)
    if args.wrap == "fsdp2+tp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, tp


def checkpointed(model, args):
    """--checkpoint: each block's activations recomputed in the backward (non-reentrant)."""
    if args.checkpoint:
        from torch.utils.checkpoint import checkpoint

        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def batch(args, step, rank, tp):
    """(input, labels): under TP, the same on every rank of a TP group (with sequence
    parallelism, this rank's slice of the sequence)."""
    if tp is None:
        torch.manual_seed(1000 * step + rank)
        return torch.randn(args.batch, 16, 64), torch.randint(0, 8, (args.batch,))
    torch.manual_seed(1000 * step + rank // tp.size())
    x, y = torch.randn(args.batch, 16, 64), torch.randint(0, 32, (args.batch, 16))
    if args.sequence_parallel:
        x = x.chunk(tp.size(), dim=1)[tp.get_local_rank()]
    return x, y


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wrap", choices=["ddp", "fsdp2", "tp", "fsdp2+tp"], default="ddp")
    p.add_argument("--sequence-parallel", action="store_true", help="TP: sequence-parallel LayerNorms")
    p.add_argument("--loss-parallel", action="store_true", help="TP: the logits sharded on the vocabulary, loss_parallel()")
    p.add_argument("--backend", default="inductor", help="eager | aot_eager | inductor (default)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--static-graph", action="store_true", help="DDP static_graph=True")
    p.add_argument("--bucket-view", action="store_true", help="DDP gradient_as_bucket_view=True")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--bf16", action="store_true", help="FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16)")
    p.add_argument("--no-reshard", action="store_true", help="FSDP2 reshard_after_forward=False")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing of each block (non-reentrant)")
    p.add_argument("--check", action="store_true", help="train an eager copy too and compare bitwise")
    p.add_argument("--timeline", action="store_true", help="print when gradient collectives were launched")
    args = p.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.timeline and args.wrap == "fsdp2":
        _time_reduce_scatters()

    from torch.distributed.tensor.parallel import loss_parallel

    is_tp = args.wrap in ("tp", "fsdp2+tp")
    copies = 2 if args.check or (args.timeline and is_tp) else 1
    models, tp = zip(*(build(args, world) for _ in range(copies)))
    tp = tp[0]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    times, fractions, mismatches, eager_log = [], {}, 0, None
    for step in range(args.steps):
        x, y = batch(args, step, rank, tp)
        grads = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            compiled = i == 0
            with loss_parallel() if args.loss_parallel else contextlib.nullcontext():
                out = model(x)
                loss = nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()) if is_tp else nn.functional.cross_entropy(out.float(), y)
                LAUNCHES.clear()
                logging = is_tp and args.timeline and not compiled and step == args.steps - 1
                t0 = time.perf_counter()
                with ca.enable(args.backend) if compiled else EagerCollectives() if logging else torch.enable_grad() as mode:
                    loss.backward()
                t1 = time.perf_counter()
            if logging:
                eager_log = mode
            if compiled:
                times.append(t1 - t0)
            fractions[i] = [(t - t0) / (t1 - t0) for t in LAUNCHES]
            grads.append([full(q.grad) for q in model.parameters()])
            opt.step()
            opt.zero_grad()
        if args.check:
            mismatches += sum(not torch.equal(a, b) for a, b in zip(*grads))
    if args.check:
        mismatches += sum(not torch.equal(full(a), full(b)) for a, b in zip(*(m.parameters() for m in models)))

    s = ca.stats()
    if rank == 0:
        late = times[len(times) // 2 :]
        print(
            f"{args.wrap} on {world} ranks, backend {args.backend}: backward median {statistics.median(late) * 1e3:.1f} ms "
            f"over the last {len(late)} steps; learning {s.learning_backwards}, captures {s.captures}, hits {s.hits}, "
            f"eager fallbacks {s.eager_fallbacks}, "
            f"opaque nodes {dict(s.opaque_reasons) or 0}"
        )
        if args.check:
            print("grads and parameters bitwise equal to eager" if mismatches == 0 else f"{mismatches} tensors differ from eager")
        if args.timeline and is_tp:
            compiled_log, n = graph_collectives(ca.graphs()[-1].graph)
            for name, log, total in (("eager", eager_log.collectives, eager_log.ops), ("compiled", compiled_log, n)):
                print(
                    f"{name}: {len(log)} collectives among {total} ops: "
                    + ", ".join(f"{op}{list(shape)} at {100 * k / total:.0f}%" for op, shape, k in log)
                )
            same = [c[:2] for c in eager_log.collectives] == [c[:2] for c in compiled_log]
            if args.checkpoint:  # (eager's log holds the recomputed forwards' collectives too)
                print(
                    "(--checkpoint: the recomputed forwards' collectives run inside the checkpoint's unpack hook, "
                    "called by the graph where eager calls it; only eager's log shows them)"
                )
            else:
                print("the compiled graph issues eager's collectives in eager's order" if same else "the collectives differ from eager's")
        elif args.timeline:
            for i, launches in fractions.items():
                print(
                    f"last step, {('compiled', 'eager')[i]}: {len(launches)} gradient collectives launched at "
                    + ", ".join(f"{100 * f:.0f}%" for f in launches)
                    + " of the backward"
                )
    # free what holds the process group before destroying it, so that gloo's workers stop
    # while Python is whole (tests/test_distributed.py: a worker left freeing a work at exit can
    # abort the process)
    models = opts = None
    ca.reset()
    gc.collect()
    dist.destroy_process_group()
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
