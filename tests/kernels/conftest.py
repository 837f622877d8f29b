"""Kernel tests run on CUDA when there is a device, else on CPU tensors in Triton's interpreter.

Triton decides between compiling and interpreting when a kernel is decorated,
that is when ``conveyor.runtime.kernels.*`` is imported, and reads the setting
again at launch. Without CUDA, this conftest imports those modules with
``TRITON_INTERPRET=1`` set and then restores the environment, and sets it
again around each test of this folder only, so it does not leak into other
test folders or the processes they start.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

KERNEL_MODULES = (
    "conveyor.runtime.kernels.store_kv",
    "conveyor.runtime.kernels.decode_attention",
    "conveyor.runtime.kernels.prefill_attention",
    "conveyor.runtime.kernels.rotary",
    "conveyor.runtime.kernels.rmsnorm",
    "conveyor.runtime.kernels.silu_and_mul",
    "conveyor.runtime.kernels.gelu_and_mul",
    "conveyor.runtime.kernels.fused_moe",
    "conveyor.runtime.kernels.backend",
)
INTERPRETED = not torch.cuda.is_available()

if INTERPRETED:
    compiled = [m for m in KERNEL_MODULES if m in sys.modules]
    if compiled and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{compiled} were imported before tests/kernels could set TRITON_INTERPRET=1"
        )
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in KERNEL_MODULES:
            importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.fixture(autouse=True)
def _triton_env(monkeypatch):
    if INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Triton 3.9 warns when this is unset (its default changes in 3.10); keep today's default.
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
