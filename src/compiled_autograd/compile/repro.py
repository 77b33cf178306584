"""A captured graph as a script anyone can run: NOTE [A graph you can run].

NOTE [A graph you can run]
Someone reporting a backend's bug needs one file that shows it, with nothing of ours in it:
torch's issue tracker asks the same of its own compiled autograd. `write` makes that file from a
cached graph (`ca.dump(path)`: graph_<i>.py), and from one whose backend failed (a compile that
raised, outputs that failed the first-run check: the error names the file). The file has:
  * the graph as torch's own repro tools write one (torch._dynamo.repro.after_aot: the module,
    its constants, and `load_args`, the inputs by shape, stride, dtype and device: random by
    default, the real values with `--real` where they were saved beside it);
  * a stand-in for `compiled_autograd::call` where the graph has calls (hooks, opaque nodes,
    AccumulateGrad): the user's code cannot run outside its backward, so each call returns zeros
    shaped as traced, and the graph's own computation around them is what is reproduced;
  * a run that compares a backend (`--backend eager|aot_eager|inductor`, the graph's own by
    default) with the eager run of the same graph: each output's shape, dtype, strides and values
    (bitwise but for inductor, within its rounding), exit status 1 where they differ; a backend of
    the user's is named `module:function`.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import tempfile

import torch

from ..calls.protocol import DEFINEDNESS, DEVICE_TYPES, DTYPES, PASSES_SHIFT

log = logging.getLogger("compiled_autograd")

_STUB = """
# compiled_autograd::call runs a hook, an opaque node or AccumulateGrad of the live backward;
# outside one, each call returns zeros shaped as the graph was traced with (NOTE [A graph you
# can run] in compiled_autograd/compile/repro.py): what this file reproduces is the graph's own
# computation around them. What each call is given (the grads a hook or AccumulateGrad gets) is
# kept, and compared as the graph's outputs are.
_DTYPES = [{dtypes}]
_DEVICES = {devices!r}
_GIVEN = []


def _call(slot, args, meta, flags):
    if not isinstance(args[0] if args else None, torch._subclasses.FakeTensor):
        _GIVEN.append((int(slot), [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
    outs, pos = [], 0
    while pos < len(meta):
        rank, dtype, device, layout = (int(v) for v in meta[pos : pos + 4])
        shape, strides = [int(v) for v in meta[pos + 4 : pos + 4 + rank]], [int(v) for v in meta[pos + 4 + rank : pos + 4 + 2 * rank]]
        pos += 4 + 2 * rank
        kind, index = divmod(device, 1024)
        dev = torch.device(_DEVICES[kind]) if index == 0 else torch.device(_DEVICES[kind], index - 1)
        t = torch.empty_strided(shape, strides, dtype=_DTYPES[dtype], device=dev).zero_()
        outs.append(t.to_sparse() if layout == 1 else t)
    if flags & {definedness}:
        outs.append(torch.ones(len(outs), dtype=torch.bool))
    n = flags >> {passes_shift}
    return outs + [a.clone() for a in args[len(args) - n :]] if n else outs


try:
    torch.ops.compiled_autograd.call.default
except (AttributeError, RuntimeError):
    _lib = torch.library.Library("compiled_autograd", "DEF")
    _lib.define("call(int slot, Tensor?[] args, int[] meta, int flags) -> Tensor[]")
    _lib.impl("call", _call, "CompositeExplicitAutograd")
    torch.library.register_fake("compiled_autograd::call", _call, lib=_lib)
    torch.fx.node.has_side_effect(torch.ops.compiled_autograd.call.default)  # (kept where nothing reads its outputs)
    try:
        from torch._library.effects import EffectType

        torch.library._register_effectful_op("compiled_autograd::call", EffectType.ORDERED)
    except Exception:  # (an older torch: kept by has_side_effect alone)
        pass
"""

_MAIN = '''

def _clone(a):
    return a.clone() if isinstance(a, torch.Tensor) else a


def _compare(backend):
    """The graph run by `backend` against its eager run, on the same inputs."""
    reader = InputReader(REAL_INPUTS if ARGS.real else None)
    torch.manual_seed(0)
    load_args(reader)
    args = reader.args
    gm = torch.fx.symbolic_trace(mod)
    with torch.no_grad():
        want = list(mod(*[_clone(a) for a in args]))
        given_eager = _GIVEN[:] if "_GIVEN" in globals() else []
        if ":" in backend:  # a user's backend, `module:function` taking (gm, example_inputs)
            import importlib

            module, name = backend.split(":")
            fn = getattr(importlib.import_module(module), name)(gm, [_clone(a) for a in args])
        elif backend == "eager":
            fn = gm
        elif backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            fn = aot_eager(gm, [_clone(a) for a in args])
        else:
            from torch._inductor.compile_fx import compile_fx

            fn = compile_fx(gm, [_clone(a) for a in args])
        given = [_clone(a) for a in args]
        if given_eager:
            _GIVEN.clear()
        got = list(fn(*given))
    if given_eager:  # (what the calls were given: compared as outputs, by call)
        given_eager.sort(key=lambda c: c[0])
        got_given = sorted(_GIVEN, key=lambda c: c[0])
        want += [a for _, args in given_eager for a in args]
        got += [a for _, args in got_given for a in args]
    exact = backend != "inductor"
    bad = 0
    if len(got) != len(want):
        print(f"{{backend}} returned {{len(got)}} outputs, eager {{len(want)}}")
        return False
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            continue
        why = None
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype or g.device != w.device:
            why = f"{{tuple(getattr(g, 'shape', ()))}}/{{getattr(g, 'dtype', type(g).__name__)}} vs eager's {{tuple(w.shape)}}/{{w.dtype}}"
        elif w.layout == torch.strided and w.numel() and g.stride() != w.stride():
            why = f"strides {{g.stride()}} vs eager's {{w.stride()}}"
        else:
            g, w = (g.to_dense(), w.to_dense()) if w.layout != torch.strided else (g, w)
            same = torch.equal(g, w) if exact else torch.allclose(g, w, rtol=1e-4, atol=1e-5, equal_nan=True)
            if not same:
                diff = (g.double() - w.double()).abs().max().item() if w.is_floating_point() else "-"
                why = f"values differ (max difference {{diff}})"
        if why is not None:
            bad += 1
            print(f"output {{i}}: {{why}}")
    print(f"{{backend}}: {{len(want) - bad}} of {{len(want)}} outputs as eager's" + ("" if bad else ": OK"))
    return bad == 0


if __name__ == "__main__":
    import argparse
    import sys

    from torch._dynamo.debug_utils import InputReader

    _parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _parser.add_argument("--backend", default={backend!r}, help="eager, aot_eager, inductor, or module:function (a backend of yours)")
    _parser.add_argument("--real", action="store_true", help="the inputs' real values (saved beside this file), not random ones")
    ARGS = _parser.parse_args()
    if ARGS.real and REAL_INPUTS is None:
        _parser.error("this file's inputs were not saved: it runs on random ones")
    sys.exit(0 if _compare(ARGS.backend) else 1)
'''


def default_dir() -> str:
    """Where a failed backend's script goes (COMPILED_AUTOGRAD_REPRO_DIR, else the temp dir)."""
    from .. import config

    return config.REPRO_DIR.read() or os.path.join(tempfile.gettempdir(), "compiled_autograd_repro")


def _concrete(v):
    """A placeholder's value as concrete metadata: sizes from their hints (a dynamic graph's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def hint(s):
        return int(s.node.hint) if isinstance(s, torch.SymInt) and s.node.hint is not None else int(s)

    if isinstance(v, torch.SymInt):
        return hint(v)
    if isinstance(v, torch.Tensor):
        with FakeTensorMode():
            if v.layout != torch.strided:
                return torch.empty([hint(s) for s in v.shape], dtype=v.dtype, device=v.device)
            return torch.empty_strided([hint(s) for s in v.shape], [hint(s) for s in v.stride()], dtype=v.dtype, device=v.device)
    return v


def write(entry, file: str, inputs=None, backend: str | None = None) -> str:
    """Write `entry`'s graph as a runnable script to `file` (NOTE [A graph you can run]);
    `inputs`: its real inputs, saved beside it for `--real`. Returns the file."""
    from torch._dynamo.repro.after_aot import generate_compiler_repro_string

    gm = entry.graph
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real_dir = None
    if inputs is not None and all(isinstance(a, (torch.Tensor, int)) for a in inputs):
        real_dir = os.path.splitext(file)[0] + "_inputs"
        args = list(inputs)
    else:
        vals = [p.meta.get("val") for p in placeholders]
        if any(v is None for v in vals) and entry.inputs is not None:  # (a graph loaded from the disk cache)
            vals = entry.inputs()
        args = [_concrete(v) for v in vals]
    kwargs = {"save_dir": real_dir} if "save_dir" in inspect.signature(generate_compiler_repro_string).parameters else {}
    body = generate_compiler_repro_string(gm, args, **kwargs)
    has_calls = any(n.op == "call_function" and str(n.target) == "compiled_autograd.call.default" for n in gm.graph.nodes)
    stub = (
        _STUB.format(
            dtypes=", ".join(f"torch.{str(d).split('.')[-1]}" for d in DTYPES),
            devices=DEVICE_TYPES,
            definedness=DEFINEDNESS,
            passes_shift=PASSES_SHIFT,
        )
        if has_calls
        else ""
    )
    name = backend or (entry.backend if entry.backend in ("eager", "aot_eager", "inductor") else "aot_eager")
    head = (
        f'"""compiled_autograd: a backward graph of {len(entry.node_names)} autograd nodes, captured for backend '
        f"{entry.backend!r} ({entry.reason}).\n\n"
        f"Run: python {os.path.basename(file)} [--backend eager|aot_eager|inductor|module:function] [--real]\n"
        'It compares the backend\'s run of the graph with the eager run of the same graph (exit status 1 where they differ)."""\n'
        "import torch\n"
    )
    text = head + stub + body + f"\nREAL_INPUTS = {real_dir!r}\n" + _MAIN.format(backend=name)
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    with open(file, "w") as f:
        f.write(text)
    return file


def write_failed(entry, inputs=None) -> str | None:
    """The script of a graph whose backend failed, in default_dir(); None where it could not be
    written (never an error of its own: the backend's is the one to report)."""
    try:
        digest = hashlib.sha256(entry.graph.code.encode()).hexdigest()[:12]
        return write(entry, os.path.join(default_dir(), f"graph_{digest}.py"), inputs)
    except Exception:  # pragma: no cover - the report of a failure must not fail
        log.debug("could not write a script of the failed graph", exc_info=True)
        return None
