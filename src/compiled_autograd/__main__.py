"""`python -m compiled_autograd demo` runs the demo (see demo.py)."""

import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv else "demo"
    if cmd == "demo":
        from .demo import main as demo

        return demo(argv)
    print(f"usage: python -m compiled_autograd demo [options]   (unknown command {cmd!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
