"""A minimal user wrapper subclass for the spike (issue 39): a tensor stored as `data * scale`,
whose dispatch unwraps (multiplies out), runs the op, and rewraps (divides by the scale of its
first ScaledTensor argument). `scale` is an inner tensor (0-dim), as FP8 training's are: a new
scale each step is new data, not a new graph. The one definition is the tests' (tests/test_subclasses.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from test_subclasses import ScaledTensor, scaled  # noqa: E402,F401
