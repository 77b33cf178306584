"""What every patch of torch's internals shares: the error of a torch laid out otherwise than a
patch expects, and the lookup that raises it (compile/torch_patches.py holds the patches'
table, compile/inductor_patches.py inductor's patches)."""

from __future__ import annotations


class LayoutDiffers(RuntimeError):
    """Torch is not laid out as a patch expects (NOTE [Torch versions] in native/__init__.py)."""


def _attr(owner, name: str):
    """`owner.name`, which a patch replaces; `LayoutDiffers` where this torch has none."""
    try:
        return getattr(owner, name)
    except AttributeError:
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
        raise LayoutDiffers(f"{where}.{name} is not in this torch") from None
