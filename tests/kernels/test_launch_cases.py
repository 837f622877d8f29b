"""The launch stage of ``conveyor bench gpu`` calls each kernel with arguments the kernel
accepts: run once here (under Triton's interpreter without a GPU), so a lent GPU's minutes
are not spent finding a wrong argument."""

from __future__ import annotations

import torch

from conveyor.bench.gpu.launch import launch_cases


def test_every_launch_case_runs(device):
    cases = launch_cases(device)
    assert any(name.startswith("triton") for name in cases)
    for name, call in cases.items():
        out = call()
        assert out is None or isinstance(out, torch.Tensor | tuple), name
