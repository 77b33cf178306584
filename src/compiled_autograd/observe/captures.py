"""Why each graph was captured: the capture log `explain()` prints, and what it says of a capture."""

from __future__ import annotations

_capture_log: list[dict] = []


MAX_CAPTURE_LOG = 256  # the capture log keeps the newest this many entries


def capture_log() -> list[dict]:
    return list(_capture_log)


def log_capture(record: dict) -> dict:
    """Append record to the capture log, dropping the oldest beyond MAX_CAPTURE_LOG, and
    return it: a background compile updates its record by reference, not by position."""
    _capture_log.append(record)
    if len(_capture_log) > MAX_CAPTURE_LOG:
        del _capture_log[: len(_capture_log) - MAX_CAPTURE_LOG]
    return record


def node_keys(capture) -> tuple:
    key, offsets = capture.key(), capture.node_key_offsets()
    return tuple(key[a:b] for a, b in zip(offsets, offsets[1:])) + (key[offsets[-1] :] if offsets else key,)


def describe_dynamic(collected, dynamic) -> list[str]:
    """Human names of the symbolic sizes of a dynamic capture."""
    if dynamic is None:
        return []
    starts = [(n.size_start, n.name) for n in collected.nodes]
    in_graph = [f"unpacked#{u.hid}.shape[{d}]" for u in collected.in_graph for d in range(u.dim)]
    out = []
    for i in dynamic.symbolic:
        if i >= collected.in_graph_start:
            out.append(in_graph[i - collected.in_graph_start])
            continue
        if i >= collected.aot_start:
            out.append(f"torch.compile'd region's saved int #{i - collected.aot_start}")
            continue
        if i < collected.n_size_inputs:
            owner = max((s for s in starts if s[0] <= i), default=(0, "?"), key=lambda s: s[0])[1]
            out.append(f"{owner} size#{i}")
            continue
        for k, (start, dim, with_strides) in enumerate(collected.tensor_positions):
            end = start + dim * (2 if with_strides else 1) + 1
            if start <= i < end:
                r = i - start
                what = f"shape[{r}]" if r < dim else ("offset" if i == end - 1 else f"stride[{r - dim}]")
                out.append(f"input{k}.{what}")
                break
    return out


def reset() -> None:
    _capture_log.clear()
