"""What a newcomer following the README runs into: library calls made a plausible wrong way, and the
--help of each command."""

import re

import pytest

from peat import playback
from peat.io import PeatError


def test_a_plan_refuses_a_kernel_given_by_its_impl_in_one_line(tmp_path):
    """kernel="kernels/my_gemm.py" (the impl, not the loaded kernel) ended the replay in
    AttributeError: 'str' object has no attribute 'op'."""
    with pytest.raises(PeatError, match=re.escape(
            "playback.Plan: kernel='kernels/my_gemm.py' is not a kernel; load one with peat.kernels.load(impl, op)")):
        playback.Plan(context=tmp_path / "context.h5", kernel="kernels/my_gemm.py")

