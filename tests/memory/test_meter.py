"""The CPU memory meter counts what is allocated, once per storage, and what is freed."""

from __future__ import annotations

import pytest
import torch

from ntp.memory_meter import PeakMeter

pytestmark = pytest.mark.memory

MIB = 1 << 20


def test_the_cpu_peak_is_the_most_live_storage_at_once():
    kept = torch.zeros(MIB // 4)  # 1 MiB alive before and through the phases
    meter = PeakMeter(torch.device("cpu"))
    with meter.phase():
        pass
    base = meter.peaks[-1]  # every tensor alive here (kept among them)
    with meter.phase():
        a = torch.ones(2 * MIB // 4)  # +2 MiB
        view = a[: MIB // 4]  # a view: no new storage
        b = a * 2  # +2 MiB: 4 MiB above the base
        del a, b  # the view keeps a's storage: 2 MiB
        c = torch.empty(3 * MIB // 4)  # +3 MiB: 5 MiB
        del c, view
    assert meter.peaks[-1] - base == 5 * MIB  # a's storage (2) and c (3) at once
    with meter.phase():
        d = torch.ones(4 * MIB // 4)
        del d
    assert meter.peaks[-1] - base == 4 * MIB
    assert kept.numel() == MIB // 4
