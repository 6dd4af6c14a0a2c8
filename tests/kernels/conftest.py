"""Where the kernel tests run.

`triton_device`: the float32 comparisons against the references. On the CPU through the Triton
interpreter when TRITON_INTERPRET=1 (CI, `make test`), else on a CUDA/XPU GPU if there is one.
`gpu_device`: the bf16 variants (tests marked `gpu`), natively compiled on a CUDA/XPU GPU only.
"""

import os

import pytest
import torch

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def accelerator() -> torch.device | None:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    return None


@pytest.fixture
def triton_device() -> torch.device:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if INTERPRET:
        return torch.device("cpu")
    if accelerator() is None:
        pytest.skip("no GPU: set TRITON_INTERPRET=1 in the environment before pytest starts "
                    "(Triton reads it at import) to run the kernels in the interpreter")
    return accelerator()


@pytest.fixture
def gpu_device() -> torch.device:
    if accelerator() is None:
        pytest.skip("needs a CUDA or XPU device")
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if INTERPRET:
        pytest.skip("bf16 kernels need compiled Triton: unset TRITON_INTERPRET")
    return accelerator()


@pytest.fixture
def rel_err():
    """rel_err(got, want) = ||got - want|| / ||want||, in float64: the bf16 tests' metric."""

    def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
        got, want = got.double(), want.double()
        return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()

    return rel_err
