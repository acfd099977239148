"""Fixtures shared by the tests that drive our NVML in this process (test_nvml*.py,
test_nvidia_smi.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import nvml_ctypes as N
from tests.support.nvidia import nvml_library


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[N.Nvml]:
    """Our libnvidia-ml.so.1, loaded once per process, with the state file re-read on every
    call; its init count is back at zero afterwards, so the next ``nvmlInit`` reads
    HWSANDBOX_NVML_ROOT afresh."""
    lib = N.Nvml(nvml_library())
    monkeypatch.setenv("HWSANDBOX_NVML_REFRESH_MS", "0")  # every call sees the tree now
    yield lib
    while lib.nvmlShutdown() == N.SUCCESS:
        pass
