"""Fixtures shared by the Triton backend's tests."""

import pytest

from attnbackends.platform import DeviceInfo


@pytest.fixture
def fake_h100(monkeypatch):
    """Builders on the CPU see an sm_90 device with 132 SMs, Triton not interpreted (they plan; nothing launches)."""
    from attnbackends.triton import backend

    monkeypatch.setattr(DeviceInfo, "current", classmethod(lambda cls, device=None: DeviceInfo.cuda(9, 0)))
    monkeypatch.setattr(backend, "is_triton_interpreted", lambda: False)
