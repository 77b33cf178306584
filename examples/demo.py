"""Demo: train a small transformer language model on synthetic data, with eager
backward and with compiled backward side by side.

Every step runs the same forward twice on the same weights: once followed by
eager backward, once by compiled backward. The demo compares all parameter
gradients, steps the optimizer with the compiled ones, then prints the backward
times, the cache counters and what was captured.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import compiled_autograd as ca


class TinyLM(nn.Module):
    def __init__(self, vocab=256, d=128, heads=4, layers=2, ff=256, seq=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos[:t]
        h = self.encoder(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def batches(steps, batch, seq, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        # a learnable pattern: next token = (token * 3 + 1) mod vocab
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        x[:, 1:] = (x[:, :-1] * 3 + 1) % vocab
        yield x[:, :-1], x[:, 1:]


def timed_backward(loss, compiled, backend):
    t0 = time.perf_counter()
    if compiled:
        with ca.enable(backend):
            loss.backward()
    else:
        loss.backward()
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python examples/demo.py", description=__doc__)
    p.add_argument("--backend", default="inductor", help="eager | aot_eager | inductor (default)")
    p.add_argument("--steps", type=int, default=12, help="at least this many steps, and 8 compiled ones")
    p.add_argument("--max-steps", type=int, default=60, help="then wait for the compile, and run 8 compiled steps (and the turns)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args(argv)

    from compiled_autograd import native

    native.load()  # build (first use) or load the C++ helper before timing anything
    torch.manual_seed(0)
    vocab = 256
    model = TinyLM(vocab=vocab, seq=args.seq)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    ca.reset()

    print(
        f"compiled_autograd demo: TinyLM ({sum(p.numel() for p in params) / 1e6:.2f}M params), "
        f"backend={args.backend}, {torch.get_num_threads()} threads"
    )
    print("Each step runs the same forward twice: one eager backward, one through compiled_autograd.")
    print("The first compiled backward captures the graph; until its compile (in a background thread")
    print("for inductor) is done, eager autograd runs those backwards ('compiling'); then the compiled code,")
    print("its first backwards in turn with eager's ('turn'), timed: a graph slower than eager is set aside.")
    print(f"{'step':>4} {'loss':>8} {'eager bw ms':>12} {'ours bw ms':>11} {'graph':>9} {'max |grad diff|':>16}  cache")
    times_e, times_c, compiled_at = [], [], None
    for step, (x, y) in enumerate(batches(args.max_steps, args.batch, args.seq, vocab)):
        opt.zero_grad(set_to_none=True)
        loss_e = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        te = timed_backward(loss_e, False, args.backend)
        eager_grads = [p.grad for p in params]
        opt.zero_grad(set_to_none=True)
        loss_c = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        graphs = ca.graphs()
        compiled = bool(graphs) and all(g.compiled for g in graphs)  # (before this backward)
        turns = ca.stats().eager_turns
        tc = timed_backward(loss_c, True, args.backend)
        turn = ca.stats().eager_turns > turns  # (this backward ran in eager, timed against the compiled graph)
        diff = max((g - p.grad).abs().max().item() for g, p in zip(eager_grads, params))
        opt.step()
        s = ca.stats()
        times_e.append(te)
        times_c.append((tc, compiled and not turn))
        if compiled and compiled_at is None:
            compiled_at = step
        kind = ("turn" if turn else "compiled") if compiled else ("captured" if step == 0 else "compiling")
        print(
            f"{step:>4} {loss_e.item():>8.4f} {te * 1e3:>12.2f} {tc * 1e3:>11.2f} {kind:>9} {diff:>16.2e}  "
            f"captures={s.captures} hits={s.hits} fallbacks={s.eager_fallbacks}"
        )
        if step + 1 >= args.steps and sum(c for _, c in times_c) >= 8:
            break
        if step + 1 == args.max_steps - 14 and compiled_at is None and args.backend == "inductor":
            t0 = time.perf_counter()
            print(f"     (the compile yields the CPU to training; waiting for it to finish ...", end="", flush=True)
            ca.synchronize()
            print(f" {time.perf_counter() - t0:.1f} s)")

    print()
    print(f"first backward: eager {times_e[0] * 1e3:.1f} ms, ours {times_c[0][0]:.2f} s (capture; the compile runs beside)")
    traced = [t for t, c in times_c[1 : (compiled_at or len(times_c))] if not c]
    if traced:
        print(
            f"while compiling ({len(traced)} steps): ours {statistics.median(traced) * 1e3:.2f} ms "
            f"(median), eager {statistics.median(times_e[1 : len(traced) + 1]) * 1e3:.2f} ms"
        )
    done = [(t, e) for (t, c), e in zip(times_c, times_e) if c]
    if done:
        ours, eager = statistics.median(t for t, _ in done), statistics.median(e for _, e in done)
        print(
            f"compiled ({len(done)} steps, from step {compiled_at}): ours {ours * 1e3:.2f} ms, eager "
            f"{eager * 1e3:.2f} ms: {ours / eager:.2f}x eager"
        )
    else:
        print(f"the compile did not finish in {args.max_steps} steps")
    print()
    ca.explain()


if __name__ == "__main__":
    main()
