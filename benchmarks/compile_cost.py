"""Where a background compile's time goes (issue 47): from the first backward of a graph to its
compiled version in use, split into the compile child's start and imports, AOTAutograd, inductor's
lowering and code generation, the C++ compiler, and the training process's load.

    python -m benchmarks.compile_cost --layers 2,8            # a transformer encoder, d=256
    python -m benchmarks.compile_cost --layers 2 --phases     # the phases of one compile (cProfile)

Each measurement is a fresh process with a fresh inductor cache (TORCHINDUCTOR_CACHE_DIR) and our
disk cache off: the cold start. `--threads` training threads (default: all cores) run no training
meanwhile, so the compile gets idle cores: the time it takes, not the share it is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_READY = r"""
import sys, time, json, os
t0 = time.perf_counter()
import torch
import compiled_autograd as ca
from compiled_autograd import native
native.load()
layers, d = int(sys.argv[1]), 256
torch.manual_seed(0)
enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True), layers,
                                  enable_nested_tensor=False)
x = torch.randn(8, 64, d)
imported = time.perf_counter() - t0
loss = enc(x).square().mean()
t_first = time.perf_counter()
with ca.enable("inductor", disk_cache=False):
    loss.backward()
first = time.perf_counter() - t_first
ca.synchronize()  # (no training meanwhile: the compile has the idle cores)
with ca.enable("inductor", disk_cache=False):
    enc(x).square().mean().backward()
times, step = [first], 1
print(json.dumps({"layers": layers, "ready_s": time.perf_counter() - t_first, "steps": step + 1, "import_s": imported,
                  "first_backward_s": times[0], "child_compiles": ca.stats().child_compiles}))
"""

_PHASES = r"""
import sys, time, json, cProfile, pstats, io
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t0
import compiled_autograd as ca
from compiled_autograd import native
native.load()
t1 = time.perf_counter()
import torch._inductor.compile_fx  # (what the compile imports)
t_inductor = time.perf_counter() - t1
layers, d = int(sys.argv[1]), 256
torch.manual_seed(0)
enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True), layers,
                                  enable_nested_tensor=False)
x = torch.randn(8, 64, d)
with ca.enable("eager", disk_cache=False):
    enc(x).square().mean().backward()
(entry,) = ca.graphs()
from compiled_autograd.compile.inductor import compile_inductor
from compiled_autograd.compile.child import Described
gm, fakes = entry.graph, Described([t for t in entry.graph.graph.nodes if False])
from compiled_autograd.compile.boxed import static_fakes
args = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
prof = cProfile.Profile()
t2 = time.perf_counter()
prof.enable()
with torch.no_grad():
    compile_inductor(gm, args, False, None)
prof.disable()
total = time.perf_counter() - t2
st = pstats.Stats(prof)
def cum(pattern):
    return max((v[3] for k, v in st.stats.items() if pattern in f"{k[0]}:{k[2]}"), default=0.0)
phases = {
    "import torch": t_torch, "import inductor": t_inductor, "compile (all)": total,
    "AOTAutograd (aot_module_simplified)": cum("aot_autograd.py:aot_module_simplified"),
    "inductor: fx passes + lowering (GraphLowering.run)": cum("graph.py:run"),
    "inductor: scheduling + codegen (GraphLowering.codegen)": cum("graph.py:codegen"),
    "C++ compiler (cpp_builder build)": cum("cpp_builder.py:build"),
    "load the generated module (PyCodeCache.load_by_key_path)": cum("codecache.py:load_by_key_path"),
}
print(json.dumps(phases))
"""


def _run(code: str, args, env) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env, timeout=1800, cwd=str(ROOT)
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="2,8")
    p.add_argument("--phases", action="store_true", help="the phases of one in-process compile (cProfile), not the background one")
    a = p.parse_args(argv)
    for layers in [int(x) for x in a.layers.split(",")]:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(
                os.environ,
                TORCHINDUCTOR_CACHE_DIR=cache,
                COMPILED_AUTOGRAD_DISK_CACHE="0",
                PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
            )
            t = time.perf_counter()
            res = _run(_PHASES if a.phases else _READY, [layers], env)
            res["process_s"] = time.perf_counter() - t
            print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
