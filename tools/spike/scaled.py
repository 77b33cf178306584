"""A minimal user wrapper subclass for the spike (issue 39): a tensor stored as `data * scale`,
whose dispatch unwraps (multiplies out), runs the op, and rewraps (divides by the scale of its
first ScaledTensor argument). `scale` is an inner tensor (0-dim), as FP8 training's are: a new
scale each step is new data, not a new graph."""
import torch
from torch.utils._pytree import tree_map


class ScaledTensor(torch.Tensor):
    @staticmethod
    def __new__(cls, data, scale, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=requires_grad)

    def __init__(self, data, scale, requires_grad=False):
        self._data = data
        self._scale = scale

    def __repr__(self):
        return f"ScaledTensor({self._data!r}, scale={self._scale!r})"

    def __tensor_flatten__(self):
        return ["_data", "_scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ScaledTensor(inner["_data"], inner["_scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        scale = None

        def unwrap(t):
            nonlocal scale
            if isinstance(t, ScaledTensor):
                if scale is None:
                    scale = t._scale
                return t._data * t._scale
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func in (torch.ops.aten.detach.default,) or not isinstance(out, (torch.Tensor, tuple, list)):
            pass

        def wrap(t):
            if isinstance(t, torch.Tensor) and not isinstance(t, ScaledTensor) and t.is_floating_point():
                return ScaledTensor(t / scale, scale)
            return t

        return tree_map(wrap, out)


def scaled(t: torch.Tensor, scale: float, requires_grad=False) -> ScaledTensor:
    s = torch.tensor(scale, dtype=t.dtype)
    return ScaledTensor(t / s, s, requires_grad=requires_grad)
