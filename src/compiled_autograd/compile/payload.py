"""What a compile child is given: the graph node by node, and its inputs by geometry (NOTE
[Compiling in a child process] in compile/child.py)."""

from __future__ import annotations

import torch


def describe(values) -> list:
    """The example inputs as the child rebuilds them: each tensor's geometry and which storage
    it shares with the others (an alias is an alias in the child too), the rest as is."""
    storages: dict = {}
    out = []
    for v in values:
        if not isinstance(v, torch.Tensor):
            out.append(("value", v))
            continue
        st = v.untyped_storage()
        key = id(st) if not hasattr(st, "_cdata") else st._cdata
        index = storages.setdefault(key, (len(storages), st.nbytes()))[0]
        out.append(
            (
                "tensor",
                tuple(v.shape),
                tuple(v.stride()),
                v.storage_offset(),
                v.dtype,
                str(v.device),
                bool(v.requires_grad),
                index,
                storages[key][1],
            )
        )
    return out


class Described:
    """Tensors by their geometry (`describe`), without a reference to them: what the child gets
    as it is, and static fakes when called (made as the child makes them, so that the
    in-process compile after the child's finds its result in the caches)."""

    def __init__(self, tensors):
        self.described = describe(tensors)

    def __call__(self) -> list:
        return fakes_of(self.described)


def fakes_of(described) -> list:
    """Static fakes of the described tensors, in a mode with a ShapeEnv (as `static_fakes`
    makes them): each on its device, sharing a storage where the tensors did, and taking no
    memory on any device. (They were once rebuilt as real CPU tensors and fakeified: the fake
    of a CUDA tensor was then a CPU one, so the child compiled a CPU graph, under another cache
    key, and the training process compiled the CUDA graph again itself, holding the GIL.)"""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    storages: dict = {}
    values = []
    for d in described:
        if d[0] == "value":
            values.append(d[1])
            continue
        _, shape, stride, offset, dtype, device, requires_grad, index, nbytes = d
        st = storages.get(index)
        if st is None:
            st = storages[index] = torch.UntypedStorage(max(nbytes, 1), device="meta")
        meta = torch.empty(0, dtype=dtype, device="meta").set_(st, offset, shape, stride)
        f = FakeTensor(mode, meta, torch.device(device))
        values.append(f.requires_grad_(True) if requires_grad else f)
    return values


def _encode_target(target):
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._opname, target._overloadname)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ("hop", target.name())
    return ("py", target)  # (pickled by reference: a module-level function)


def _decode_target(encoded):
    if encoded[0] == "op":
        _, namespace, name, overload = encoded
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    if encoded[0] == "hop":
        return getattr(torch.ops.higher_order, encoded[1])
    return encoded[1]


class _NodeRef:
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


def encode_graph(gm: torch.fx.GraphModule) -> dict:
    """The graph node by node, its names kept: inductor's cache keys read the graph's code, and
    a GraphModule pickles as its code, which the other side re-traces under other names."""
    nodes = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            raise ValueError("a graph with attributes")
        ref = lambda a: _NodeRef(a.name)  # noqa: E731
        args = torch.fx.node.map_arg(n.args, ref)
        kwargs = torch.fx.node.map_arg(n.kwargs, ref)
        target = _encode_target(n.target) if n.op == "call_function" else n.target
        nodes.append((n.op, n.name, target, args, kwargs, n.type))
    graph = gm.graph
    return {
        "class_name": type(gm).__name__,
        "nodes": nodes,
        "tracer": (getattr(graph, "_tracer_cls", None), getattr(graph, "_tracer_extras", None)),
    }


def decode_graph(encoded: dict) -> torch.fx.GraphModule:
    import torch.utils._pytree as pytree

    tracer_cls, tracer_extras = encoded["tracer"]
    graph = torch.fx.Graph(tracer_cls=tracer_cls, tracer_extras=tracer_extras)
    env: dict = {}

    def look(a):
        return pytree.tree_map(lambda x: env[x.name] if isinstance(x, _NodeRef) else x, a, is_leaf=lambda x: isinstance(x, _NodeRef))

    for op, name, target, args, kwargs, type_ in encoded["nodes"]:
        target = _decode_target(target) if op == "call_function" else target
        node = graph.create_node(op, target, tuple(look(list(args))), look(dict(kwargs)), name=name, type_expr=type_)
        env[name] = node
    return torch.fx.GraphModule({}, graph, class_name=encoded["class_name"])
