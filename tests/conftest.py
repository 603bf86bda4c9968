"""Test-run configuration: with no GPU, the Triton kernels are tested through Triton's interpreter.

Triton reads TRITON_INTERPRET once, when it is first imported, so it is set here, at the start of the
test run and before any test module imports triton; on a machine with CUDA the kernels run compiled.
"""

import os


def pytest_configure(config):
    config.addinivalue_line("markers", "interpret: runs the Triton kernels through Triton's interpreter")
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
