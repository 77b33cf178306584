"""Why a capture: the dynamic-shape policy (which sizes of a capture become symbols; NOTE [One
symbol per size class] in capture/fakes.py for how), and why a key is new."""

from __future__ import annotations

from ..config import Config
from ..observe.captures import node_keys
from ..cache.memory import CACHE


def _eligible(collected) -> list[bool]:
    """Size positions that may become symbolic: all of them (a tensor whose
    strides do not follow from its sizes gets symbolic strides and offset)."""
    return [True] * len(collected.sizes)


MAX_DYNAMIC_PER_KEY = 3


def new_key_reason(collected) -> str:
    """Why a key is new: the first node whose part of the key differs from the
    nearest cached graph with the same nodes, or that the nodes differ."""
    entries = CACHE.entries()
    if not entries:
        return "first backward"
    names = tuple(n.name for n in collected.nodes)
    same = [e for e in entries if e.node_names == names]
    if not same:
        return "new graph structure (nodes differ from every cached graph)"
    mine = node_keys(collected.walk)
    best = None
    for e in same:
        diff = [i for i, (a, b) in enumerate(zip(mine, e.node_keys)) if a != b]
        if best is None or len(diff) < len(best):
            best = diff
    if not best:
        return "same nodes as a cached graph; custom Function state, saved-tensor hooks or backend options differ"
    i = best[0]
    if i == len(names):
        what = "the lifted tensors' dtype, device, layout or requires_grad"
    else:
        what = f"node #{i} {names[i]}: a saved constant, hook count or the metadata of its edges"
    more = f" (and {len(best) - 1} more)" if len(best) > 1 else ""
    return f"same nodes as a cached graph, but {what} differ{more}"


def plan_capture(cfg: Config, fam, collected) -> tuple[tuple | None, str]:
    """(which sizes to make symbolic, or None for a static graph; why this capture).

    Policy (the reference's): the first graph of a key is static. When the key
    comes back with other sizes, the positions that differ from what is cached
    become symbolic, together with those already symbolic in earlier dynamic
    graphs of the key; the rest stay static, so kernels stay specialized where
    nothing varies. When a dynamic graph's guards fail on sizes it covers (the
    trace or the compiler assumed something, e.g. divisibility), the same
    positions are captured again with the new sizes as hints, a few times at
    most; after that, static graphs."""
    if collected.subclasses or collected.held:  # (tensor subclasses: static graphs only, for now; docs/design/subclasses.md step 8)
        return None, (new_key_reason(collected) if fam is None or not len(fam) else "same structure, new sizes (static: tensor subclasses)")
    if fam is None or not len(fam):
        reason = new_key_reason(collected)
        if cfg.dynamic is True:
            return tuple(_eligible(collected)), reason + " (dynamic=True)"
        return None, reason
    if cfg.dynamic is False:
        return None, "same structure, new sizes (dynamic=False)"
    sizes = collected.sizes
    covered = [False] * len(sizes)
    changed = [False] * len(sizes)
    for e in fam.entries():
        for i, v in enumerate(sizes):
            if e.dynamic is not None and e.dynamic.mask[i]:
                covered[i] = True
            elif e.sizes[i] != v:
                changed[i] = True
    # a position a dynamic graph already covers did not change in the sense that matters:
    # that graph's guards failed (it specialized: a backward that turns a size into a
    # Python number), which is bounded below, not a reason for yet another dynamic graph
    changed = [c and not cov for c, cov in zip(changed, covered)]
    mask = tuple(a or b for a, b in zip(covered, changed))
    if not any(changed):
        if len(fam.dynamic) >= MAX_DYNAMIC_PER_KEY:
            return None, "guards of the dynamic graphs failed; static graph"
        return mask, "guards of the dynamic graph failed; dynamic again with these sizes"
    return mask, f"same structure, new sizes: {sum(mask)} sizes symbolic"
