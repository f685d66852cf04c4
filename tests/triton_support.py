"""What the Triton kernel tests share: skip without a way to run Triton, patch its interpreter.

Import it at the top of a test module, before the kernel modules:

    from tests.triton_support import DEVICE, INTERPRETED

The module is skipped unless there is a CUDA device, or TRITON_INTERPRET=1 and triton is
installed (then the kernels run on the CPU under Triton's interpreter).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not INTERPRETED:
    pytest.skip("Triton needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
if INTERPRETED:
    # Triton's interpreter turns a loaded scalar into a 1-element array and int()s it for range();
    # NumPy >= 2.4 refuses that. Index through the single element instead (interpreter only).
    import triton.runtime.interpreter as _interp

    _patch_tensor = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if not getattr(_interp, "_deepinfer_patched", False):
        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._deepinfer_patched = True

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
