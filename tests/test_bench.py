"""The benchmark's memory measure: the peak of the allocator's events, exact to the byte."""

import torch

from benchmarks.worker import tensor_peak_mb

MB = 2**20


def test_tensor_peak_counts_what_is_alive_at_once():
    def fn():
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)
        del a
        c = torch.empty(MB // 2, dtype=torch.uint8)
        del b, c

    assert tensor_peak_mb(fn) == 3.0

