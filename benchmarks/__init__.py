"""The backward-pass benchmark (see run.py and docs/bench/)."""
