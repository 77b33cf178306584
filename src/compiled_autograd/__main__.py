"""`python -m compiled_autograd demo` runs the demo (see demo.py);
`python -m compiled_autograd bench` runs the backward benchmark (benchmarks/run.py, from a checkout)."""

import sys
from pathlib import Path


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv else "demo"
    if cmd == "demo":
        from .demo import main as demo

        return demo(argv)
    if cmd == "bench":
        # benchmarks/ lives at the repository root, next to src/: put the root on sys.path.
        root = Path(__file__).resolve().parents[2]
        if (root / "benchmarks" / "run.py").is_file() and str(root) not in sys.path:
            sys.path.insert(0, str(root))
        try:
            from benchmarks.run import main as bench
        except ImportError as e:
            print(f"compiled_autograd bench: needs the repository checkout's benchmarks/ ({e})", file=sys.stderr)
            return 2
        return bench(argv, prog="python -m compiled_autograd bench")
    print(
        f"usage: python -m compiled_autograd demo|bench [options]   (unknown command {cmd!r})",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
