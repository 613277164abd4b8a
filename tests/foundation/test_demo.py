"""The README's first command: `tessera demo` runs end to end against its own control plane."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.foundation

TESSERA = Path(sys.executable).with_name("tessera")


def test_demo_applies_the_example_and_refuses_a_bad_job(tmp_path: Path) -> None:
    env = {**os.environ, "TESSERA_STATE_DIR": str(tmp_path)}
    try:
        demo = subprocess.run([str(TESSERA), "demo"], env=env, capture_output=True, text=True,
                              timeout=300)
        out = demo.stdout + demo.stderr
        assert demo.returncode == 0, out
        assert "ntptrainingjob.tessera.dev/llama-8b-small created" in out
        assert "llama-8b-small" in out.split("kubectl get ntpjob", 1)[1]
        assert "boostCapWatts" in out and "must be" in out
        # the failure flow: degraded at TP 7 with boosted survivors, then back at TP 8
        cordoned = out.split("tessera cordon-gpu gpu-node-0 3", 1)[1]
        assert "Degraded" in cordoned and "7,8" in cordoned
        boosted = cordoned.split("GPU 3 of gpu-node-0 cordoned", 1)[1].split("uncordon", 1)[0]
        node0 = next(line for line in boosted.splitlines() if "gpu-node-0" in line)
        watts = [int(w) for w in re.findall(r"(\d+) W", node0)]
        assert watts[3] == 200 and min(watts[:3] + watts[4:]) > 600, node0
        # the control plane outlives the demo, as the README says, until `tessera down`
        kubeconfig = tmp_path / "controlplane" / "kubeconfig"
        got = subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", "get", "ntpjob",
                              "llama-8b-small", "-o", "name"],
                             capture_output=True, text=True, timeout=60)
        assert got.stdout.strip() == "ntptrainingjob.tessera.dev/llama-8b-small", got.stderr
    finally:
        subprocess.run([str(TESSERA), "down"], env=env, capture_output=True, timeout=120)
    assert not (tmp_path / "controlplane").exists()
