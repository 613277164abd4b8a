"""The simulated dcgm-exporter page: both field-name generations as dcgm-exporter prints them,
a failed GPU's XID, blank values, and a real Prometheus scraping it."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera_agents.power.sim_backend import SimBackend
from tessera_dev.simnode.dcgm import render

pytestmark = pytest.mark.cluster

W = 1000
HOST = "gpu-node-0"

# Facts, from dcgm-exporter's shipped etc/default-counters.csv (4.8 line: names, types and
# units in the help texts), its 4.8.4 release notes (opt-in DCGM_FI_DEV_POWER_MGMT_LIMIT and
# DCGM_FI_DEV_ENFORCED_POWER_LIMIT), and the 4.9.0 release notes with go-dcgm's DCGM 4.7 rename
# tables (base-unit fields 1603 SM_CLOCK_HERTZ and 1611 GPU_ENERGY_JOULES_TOTAL; aliases
# GPU_TEMP -> GPU_TEMP_CELSIUS, POWER_USAGE -> BOARD_POWER_WATTS, XID_ERRORS -> XID_ERROR;
# utilization as a 0-1 ratio): family -> (type, value from the NVML reading and the elapsed
# energy, in the family's unit).
Facts = dict[str, tuple[str, Callable[[dict], float]]]
FACTS_4_8: Facts = {
    "DCGM_FI_DEV_SM_CLOCK": ("gauge", lambda r: r["sm_clock_mhz"]),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", lambda r: r["temp_c"]),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", lambda r: r["power_mw"] / W),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("counter", lambda r: r["energy_mj"]),
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", lambda r: 100),
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", lambda r: 0),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("gauge", lambda r: r["limit_mw"] / W),
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": ("gauge", lambda r: r["enforced_mw"] / W),
}
FACTS_4_9: Facts = {
    "DCGM_FI_DEV_SM_CLOCK_HERTZ": ("gauge", lambda r: r["sm_clock_mhz"] * 1_000_000),
    "DCGM_FI_DEV_GPU_TEMP_CELSIUS": ("gauge", lambda r: r["temp_c"]),
    "DCGM_FI_DEV_BOARD_POWER_WATTS": ("gauge", lambda r: r["power_mw"] / W),
    "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL": ("counter", lambda r: r["energy_mj"] // 1000),
    "DCGM_FI_DEV_GPU_UTIL_RATIO": ("gauge", lambda r: 1),
    "DCGM_FI_DEV_XID_ERROR": ("gauge", lambda r: 0),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("gauge", lambda r: r["limit_mw"] / W),
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": ("gauge", lambda r: r["enforced_mw"] / W),
}
FACTS = {"4.8": FACTS_4_8, "4.9": FACTS_4_9}
LAST_XID = {"4.8": "DCGM_FI_DEV_XID_ERRORS", "4.9": "DCGM_FI_DEV_XID_ERROR"}
# dcgm-exporter's label set (4.8.3 on: `hostname`, lowercase) and the driver label its default
# CSV adds, renamed in 4.9.0.
IDENTITY = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "hostname")
DRIVER_LABEL = {"4.8": "DCGM_FI_DRIVER_VERSION", "4.9": "DCGM_FI_SYSTEM_DRIVER_VERSION"}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _families(page: str) -> dict[str, tuple[str, list]]:
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(page)}


def _by_uuid(samples: list) -> dict[str, list]:
    grouped: dict[str, list] = {}
    for s in samples:
        grouped.setdefault(s.labels["UUID"], []).append(s)
    return grouped


@pytest.mark.parametrize("generation", ["4.8", "4.9"])
def test_each_generation_has_dcgm_exporters_names_types_units_and_labels(generation: str) -> None:
    clock = Clock()
    gpus = SimBackend(3, HOST, clock=clock)
    gpus.set_limit(1, 455 * W)
    clock.now += 40  # 40 s at 700, 455 and 700 W
    families = _families(render(gpus.snapshot(), hostname=HOST, generation=generation))
    facts = FACTS[generation]
    assert set(facts) <= set(families)
    assert not set(FACTS["4.9" if generation == "4.8" else "4.8"]) - set(facts) & set(families)
    for index in range(3):
        reading = dataclasses.asdict(gpus.read(index))
        reading["temp_c"] = round(30 + 0.06 * reading["power_mw"] / W)
        reading["energy_mj"] = reading["power_mw"] * 40  # mW * s = mJ
        uuid = reading["uuid"]
        for name, (type_, expected) in facts.items():
            family_type, samples = families[name]
            assert family_type == type_, name
            [sample] = _by_uuid(samples)[uuid]
            assert sample.value == expected(reading), (name, index)
            assert list(sample.labels)[:7] == [*IDENTITY, DRIVER_LABEL[generation]]
            assert (sample.labels["gpu"], sample.labels["device"], sample.labels["hostname"]) == (
                str(index), f"nvidia{index}", HOST)
            assert sample.labels["pci_bus_id"].count(":") == 2
            assert "Hostname" not in sample.labels


@pytest.mark.parametrize("generation", ["4.8", "4.9"])
def test_a_failed_gpu_shows_its_xid_and_loses_its_other_series(generation: str) -> None:
    clock = Clock()
    gpus = SimBackend(2, HOST, clock=clock)
    failed = gpus.snapshot()[1].uuid
    gpus.fail(1, xid=79)
    families = _families(render(gpus.snapshot(), hostname=HOST, generation=generation))
    for name in FACTS[generation]:
        present = set(_by_uuid(families[name][1]))
        assert present == ({gpus.snapshot()[0].uuid, failed} if name == LAST_XID[generation]
                           else {gpus.snapshot()[0].uuid}), name
    [last] = _by_uuid(families[LAST_XID[generation]][1])[failed]
    assert last.value == 79
    [count] = _by_uuid(families["DCGM_EXP_XID_ERRORS_COUNT"][1])[failed]
    assert (count.labels["xid"], count.labels["window_size_in_ms"], count.value) == ("79", "300000",
                                                                                     1)
    [total] = _by_uuid(families["DCGM_EXP_XID_ERRORS_TOTAL"][1])[failed]
    assert (total.labels["xid"], total.value) == ("79", 1)
    health = _by_uuid(families["DCGM_EXP_GPU_HEALTH_STATUS"][1])
    # DCGM health results: 0 pass, 10 warn, 20 fail
    assert sorted(s.value for s in health[failed]) == [0] * 9 + [20]
    assert {s.labels["health_error_code"] for s in health[failed] if s.value == 20} == {
        "DCGM_FR_XID_ERROR"}
    assert {s.value for s in health[gpus.snapshot()[0].uuid]} == {0}

    # back after a restore; the XID still counts in the exporter's 5-minute window, then not
    gpus.restore(1)
    clock.now += 299
    families = _families(render(gpus.snapshot(), hostname=HOST, generation=generation))
    [last] = _by_uuid(families[LAST_XID[generation]][1])[failed]
    assert last.value == 0
    assert set(_by_uuid(families[next(iter(FACTS[generation]))][1])) == {
        s.uuid for s in gpus.snapshot()}
    assert [s.value for s in _by_uuid(families["DCGM_EXP_XID_ERRORS_COUNT"][1])[failed]] == [1]
    clock.now += 2
    families = _families(render(gpus.snapshot(), hostname=HOST, generation=generation))
    [count] = _by_uuid(families["DCGM_EXP_XID_ERRORS_COUNT"][1])[failed]
    assert ("xid" in count.labels, count.value) == (False, 0)  # the exporter's empty-window sample
    [total] = _by_uuid(families["DCGM_EXP_XID_ERRORS_TOTAL"][1])[failed]
    assert total.value == 1


def test_blank_values_are_skipped_as_the_exporter_skips_dcgm_blanks() -> None:
    snap = SimBackend(1, HOST).snapshot()[0]
    # DCGM's blanks: 2**47 and up for doubles, 0x7ffffffffffffff0 and up for integers
    blank = dataclasses.replace(
        snap, uuid="GPU-blank", power_w=math.nan, temp_c=None, sm_clock_mhz=math.inf,
        energy_mj=float(2**47), limit_w=2.0**47 + 2, last_xid=0x7FFFFFFFFFFFFFF1)
    families = _families(render([snap, blank], hostname=HOST, generation="4.8"))
    for name in ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_SM_CLOCK",
                 "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_POWER_MGMT_LIMIT",
                 "DCGM_FI_DEV_XID_ERRORS"):
        assert set(_by_uuid(families[name][1])) == {snap.uuid}, name
    [enforced] = _by_uuid(families["DCGM_FI_DEV_ENFORCED_POWER_LIMIT"][1])["GPU-blank"]
    assert enforced.value == 700


@pytest.mark.parametrize(("watts", "printed"), [
    # Go's fmt %g: shortest round-trip digits, %e form from exponent 6 on or below -4
    (700.0, "700"), (612.5, "612.5"), (123456.0, "123456"), (1234567.0, "1.234567e+06"),
    (1.98e9, "1.98e+09"), (0.0001, "0.0001"), (0.00001, "1e-05"), (0.0, "0"),
])
def test_values_print_as_go_prints_them(watts: float, printed: str) -> None:
    snap = dataclasses.replace(SimBackend(1, HOST).snapshot()[0], power_w=watts)
    page = render([snap], hostname=HOST, generation="4.8")
    [line] = [x for x in page.splitlines() if x.startswith("DCGM_FI_DEV_POWER_USAGE{")]
    assert line.rsplit(" ", 1)[1] == printed


def test_families_come_sorted_by_name_and_samples_by_uuid() -> None:
    gpus = SimBackend(4, HOST).snapshot()
    page = render(list(reversed(gpus)), hostname=HOST, generation="4.9")
    names = [line.split()[2] for line in page.splitlines() if line.startswith("# TYPE")]
    assert names == sorted(names)
    clocks = [line for line in page.splitlines() if line.startswith("DCGM_FI_DEV_SM_CLOCK_HERTZ")]
    uuids = [line.split('UUID="')[1].split('"')[0] for line in clocks]
    assert uuids == sorted(g.uuid for g in gpus)


def test_an_unknown_generation_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'4\.7'.*4\.8, 4\.9"):
        render([], hostname=HOST, generation="4.7")


@pytest.fixture
def exporters() -> Iterator[Callable[[SimBackend, str], str]]:
    """Factory: serve render(gpus.snapshot()) live on a free port; returns host:port."""
    servers: list[ThreadingHTTPServer] = []

    def serve(gpus: SimBackend, generation: str) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server API)
                body = render(gpus.snapshot(), hostname=HOST, generation=generation).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def test_prometheus_scrapes_both_generations(prometheus, exporters, tmp_path) -> None:
    gpus = SimBackend(2, HOST, state_path=tmp_path / "gpus.json")
    gpus.set_limit(0, 512 * W)
    prom = prometheus({"dcgm48": [exporters(gpus, "4.8")], "dcgm49": [exporters(gpus, "4.9")]})
    for job, limit, clock in (("dcgm48", "DCGM_FI_DEV_POWER_MGMT_LIMIT", "DCGM_FI_DEV_SM_CLOCK"),
                              ("dcgm49", "DCGM_FI_DEV_POWER_MGMT_LIMIT",
                               "DCGM_FI_DEV_SM_CLOCK_HERTZ")):
        samples = prom.wait_for(f'{limit}{{job="{job}"}}', lambda s: len(s) == 2)
        assert sorted((s.labels["gpu"], s.value) for s in samples) == [("0", 512.0), ("1", 700.0)]
        assert {s.labels["hostname"] for s in samples} == {HOST}
        scale = 1 if job == "dcgm48" else 1_000_000
        [sm] = prom.query(f'{clock}{{job="{job}",gpu="0"}}')
        assert sm.value == gpus.read(0).sm_clock_mhz * scale
    energy = prom.wait_for('DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL{gpu="1"}')
    assert energy[0].value > 0

    # the GPU fails: the next scrapes show its XID in both generations
    failed = gpus.snapshot()[1].uuid
    gpus.fail(1, xid=79)
    for query in (f'DCGM_FI_DEV_XID_ERRORS{{UUID="{failed}"}}',
                  f'DCGM_FI_DEV_XID_ERROR{{UUID="{failed}"}}'):
        prom.wait_for(query, lambda s: [x.value for x in s] == [79.0])
    prom.wait_for(f'DCGM_EXP_XID_ERRORS_COUNT{{UUID="{failed}",xid="79"}}',
                  lambda s: [x.value for x in s] == [1.0, 1.0])
