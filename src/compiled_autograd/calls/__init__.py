"""The call protocol: the one opaque operator a captured graph may contain.

NOTE [Opaque calls]
Hooks (tensor, pre, post, retain_grad, post-accumulate-grad), nodes that cannot
be traced, and AccumulateGrad when something in the graph may observe `.grad`
run on real tensors in the middle of the compiled graph. Each such point is one
`compiled_autograd::call(slot, args, ...)`:
  * `slot` names what to run: a row of the entry's slot table, `(kind, node)`;
    the objects to run (hook functions, nodes) come from the current backward's
    collected graph, so a new hook closure each step is not a new graph. What a
    kind runs is its node family's row (nodes/__init__.py SLOT_KINDS), which the
    kernel (calls/kernel.py) and the native helper's direct call both follow.
  * the output metadata rides along as arguments, so the fake implementation
    needs no side table and every backend (aot_eager, inductor) can trace it
    (calls/protocol.py: the arguments, the flags, the encoding).
  * the operator is registered as an ORDERED effect: no backend may reorder or
    drop it, so hooks observe what they would observe in eager.
Outputs are owned by the graph (NOTE [Outputs the graph owns]) and in the layout it
was traced with (NOTE [Layouts of call outputs]); a real output whose shape, dtype
or device differs from what the graph was traced with raises instead of being
misread by compiled code.

Importing this package registers nothing: `install()` does, once (the package's import
calls it, api.py).
"""

from __future__ import annotations

import threading
import warnings

import torch

from . import kernel

_installed = False
_lock = threading.Lock()
_library = None  # the registrations live as long as this library object
_call = None  # the custom op (install())
_exempted = False


def install() -> None:
    """Register `compiled_autograd::call` with torch, once: its kernels, its fake, its ORDERED
    effect, and the direct call inductor's code uses."""
    global _installed, _library
    if _installed:  # (every enable() scope asks: no lock once done)
        return
    with _lock:
        if _installed:
            return
        call = torch.library.custom_op("compiled_autograd::call", kernel.call, mutates_args=())
        # The kernel is registered once more, directly: custom_op's wrapper of it checks that no
        # output aliases an input, which a hook that returns its grad unchanged may do here (NOTE
        # [Outputs the graph owns]: only where that is safe), and costs a few microseconds a call.
        lib = torch.library.Library("compiled_autograd", "FRAGMENT")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Overriding a previously registered kernel"
            lib.impl("call", kernel.call, "CompositeExplicitAutograd", allow_override=True)
            lib.impl("call", kernel.at_autograd, "Autograd", allow_override=True)
        op = torch.ops.compiled_autograd.call.default
        kernel._op = op
        op._compiled_autograd_direct = kernel.direct  # (kernel.DIRECT_KERNEL_NAME)
        global _call
        _call = call
        call.register_fake(kernel.call_fake)
        _register_effect()
        # graph passes that only know FX's own notion of purity must not drop it either
        torch.fx.node.has_side_effect(op)
        _library = lib
        _installed = True


def exempt_from_aliasing_check() -> None:
    """AOTAutograd runs a compiled function's first call under a mode that checks that no custom
    op's output aliases its input (torch._functorch.config.check_custom_op_aliasing; an error
    where the environment sets CI, a warning elsewhere). A call that hands its grad back does
    alias, where that is safe (NOTE [Outputs the graph owns]), so under that mode the call runs
    unchecked; every other op is still checked. Done before a backend compiles (compile/), not
    at install: it imports dynamo (1.1 s, torch 2.13), which a process that loads its graphs
    compiled (NOTE [Compiled graphs loaded without inductor]) never needs."""
    global _exempted
    install()
    if _exempted:
        return
    with _lock:
        if _exempted:
            return
        import torch._dynamo  # noqa: F401  (imported first, runtime_wrappers' import is circular)

        try:
            from torch._functorch._aot_autograd.runtime_wrappers import _AnalyzeCustomOpInputOutputMode
        except ImportError:  # pragma: no cover - another torch
            _exempted = True
            return

        def unchecked(mode, func, types, args, kwargs):
            return func(*args, **(kwargs or {}))

        _call.register_torch_dispatch(_AnalyzeCustomOpInputOutputMode, unchecked)
        _exempted = True


def _register_effect() -> None:
    try:
        from torch._library.effects import EffectType

        torch.library._register_effectful_op("compiled_autograd::call", EffectType.ORDERED)
    except Exception:  # pragma: no cover - older torch
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(torch.ops.compiled_autograd.call.default, _EffectType.ORDERED)
