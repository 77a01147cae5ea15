"""A device type torch parses but this build or machine cannot use ("mps"
on Linux, "xla" without torch_xla, "hpu" without its plugin) is a
:class:`DeviceError` at construction, for every pool, as docs/api.md's
differences table promises ("DeviceError for a device torch cannot use").

Before, torch.device() accepted the name and nothing else was asked: the
row pools raised the backend's own NotImplementedError / AssertionError /
ModuleNotFoundError from their first tensor, and a KVPagePool was built
and then raised those from every alloc (RuntimeError "PyTorch is not
linked with support for mps devices").
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncpool import AsyncReqToTokenPool, DeviceError, KVPagePool, ReqToTokenPool


def _usable(device: str) -> bool:
    try:
        torch.empty(0, dtype=torch.int64).to(device)
        torch.empty(0, dtype=torch.int64, device=device)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("device", ["mps", "xla", "hpu", "ipu", "xpu:0"])
@pytest.mark.parametrize(
    "make",
    [
        lambda d: ReqToTokenPool(10, 16, device=d),
        lambda d: AsyncReqToTokenPool(10, 16, device=d),
        lambda d: KVPagePool(10, 4, device=d),
    ],
    ids=["ReqToTokenPool", "AsyncReqToTokenPool", "KVPagePool"],
)
def test_a_device_this_torch_cannot_use_is_a_device_error(make: Any, device: str) -> None:
    if _usable(device):
        pytest.skip(f"{device} is usable on this machine")
    with pytest.raises(DeviceError, match=rf"device='{device}' is not a device torch can use"):
        make(device)


def test_the_cpu_with_an_index_is_still_taken() -> None:
    kv = KVPagePool(10, 4, device="cpu:0")
    pages = kv.alloc(3)
    assert pages is not None and kv.free(pages) == 3
    kv.check_invariants()
