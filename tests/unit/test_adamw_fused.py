"""`train/optim.py`'s `adamw`: torch's fused kernel where every parameter allows it, and the same update.

The fused kernel and the default multi-tensor path compute one AdamW update in a different order of operations,
so the two agree to float rounding, not bit for bit; a parameter the kernel cannot take keeps the default path.
"""

from __future__ import annotations

import torch

from relax_pipeline.train.optim import OptimSettings, adamw


def _params(seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_cpu_parameters_take_the_fused_kernel_and_the_same_update() -> None:
    settings = OptimSettings(lr=1e-2, weight_decay=0.1)
    fused, plain = _params(0), _params(0)
    optimizer = adamw(fused, settings)
    assert optimizer.defaults["fused"] is True
    reference = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        optimizer.step()
        reference.step()
    for mine, theirs in zip(fused, plain, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def test_a_parameter_the_kernel_cannot_take_keeps_the_default_path() -> None:
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, device="meta"))]
    assert not adamw(params, OptimSettings()).defaults["fused"]
