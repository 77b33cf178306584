"""Conformance runner: compiled backward vs eager autograd over torch's OpInfo and ModuleInfo tables.

    python -m tools.conformance [--backend eager|aot_eager] [--ops-only|--modules-only]
        [--filter SUBSTR] [--sample N] [--every K] [--dtypes float32,float64] [--disk-cache]
        [--out docs/conformance] [--stem NAME] [--render docs/conformance/conformance_eager.json.gz]

For every op of `torch.testing._internal.common_methods_invocations.op_db` that supports
autograd (float32 and float64 where the op supports them on CPU) and every module of
`torch.testing._internal.common_modules.module_db`, and for each of their sample inputs:

1. run the forward and reduce every differentiable floating output to one scalar loss with
   fixed random weights;
2. backward in eager autograd and record the grad of every input that requires grad (a
   sample's non-leaf inputs are first detached into leaves of the same layout; a module's
   parameters count as inputs);
3. the same forward again, backward inside `ca.enable(backend)`, compare every grad with
   `torch.testing.assert_close`;
4. give every floating input tensor new values in place (same shapes, dtypes, strides: one
   random scale in [0.75, 0.95] per tensor times a 1e-3 per-element jitter, which keeps the
   signs, zeros and value ranges samples rely on), and repeat 2 and 3 through the SAME cache
   entry, without resetting it -- a graph that baked in a value
   it should have lifted gives a wrong gradient here; a key that contains a value it should
   not gives a recapture (`recaptured`).

Multi-input samples are also run through `torch.autograd.grad(loss, inputs=subset)` (mode
`grad_subset`, every other input). Mode `create_graph` (not in the default modes; ops whose
OpInfo supports gradgrad) runs `grad(loss, inputs, create_graph=True)`, then the backward of a
weighted sum of those grads, both in the scope, and compares the first- and second-order
grads and which first-order grads require grad. The cache and counters are reset before every case, so
the `ca.stats()` differences belong to that case alone. The on-disk graph cache is off; with
`--disk-cache` every case also drops the in-memory cache after step 4 and runs the second
value set once more, which must load the graph from disk and give the same grads.

Each case ends in one status:
  compiled             correct, no eager fallback, no opaque node
  opaque               correct, some nodes ran eagerly inside the compiled graph
  fallback             correct, the backward ran in eager autograd (reason recorded)
  wrong                a gradient differs from eager (input and max abs diff recorded)
  error                compiled_autograd raised where eager did not
  skipped_eager_error  eager itself raised: not a compiled_autograd case
  skipped_no_grad      nothing to differentiate (no differentiable output / input)
`recaptured` is a flag on top of the status; a `compiled` case that recaptured is not
counted as compiled in the totals.

The library API is `run(...)`, returning a `Report`; `write(report, out_dir)` writes
`STEM.json.gz` (one case per line) and `STEM.md`.
"""

from .case import Subject, run_case
from .cli import main, write
from .driver import DTYPES, run
from .markdown import to_markdown
from .report import BUG_STATUSES, STATUSES, TOTAL_COLUMNS, CaseResult, Report, from_json, to_json, totals
from .tables import ModuleSubject, OpSubject, op_full_name, run_module, run_op, select_modules, select_ops
from .tensors import DEFAULT_TOL

__all__ = [
    "BUG_STATUSES",
    "DEFAULT_TOL",
    "DTYPES",
    "STATUSES",
    "TOTAL_COLUMNS",
    "CaseResult",
    "Report",
    "Subject",
    "OpSubject",
    "ModuleSubject",
    "run",
    "run_case",
    "run_op",
    "run_module",
    "select_ops",
    "select_modules",
    "op_full_name",
    "totals",
    "to_json",
    "from_json",
    "to_markdown",
    "write",
    "main",
]
