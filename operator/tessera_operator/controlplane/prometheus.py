"""A Prometheus server on loopback with a generated scrape config, and a small query helper."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tessera_operator.controlplane import processes

SCRAPE_INTERVAL = "1s"


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


def scrape_config(jobs: Mapping[str, Sequence[str]], interval: str = SCRAPE_INTERVAL) -> dict:
    """A Prometheus config scraping each job's host:port targets at /metrics."""
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(targets)}]}
            for job, targets in jobs.items()
        ],
    }


@dataclass
class Prometheus:
    """A running Prometheus; a context manager that stops it (and removes its data) on exit."""

    url: str
    data_dir: Path
    owns_data_dir: bool
    _proc: subprocess.Popen | None = field(repr=False, default=None)

    @classmethod
    def start(
        cls, jobs: Mapping[str, Sequence[str]], data_dir: Path | None = None,
        binary: str | None = None, timeout: float = 60.0,
    ) -> Prometheus:
        exe = binary or shutil.which("prometheus")
        if exe is None:
            raise FileNotFoundError("prometheus is not installed (Debian package `prometheus`)")
        root, owns = processes.work_dir(data_dir, "tessera-prom-")
        config = root / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(jobs)))
        port = processes.free_port()
        log = root / "prometheus.log"
        proc = processes.spawn([
            exe, f"--config.file={config}", f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",  # lets reload() pick up a new scrape config
        ], log)
        server = cls(f"http://127.0.0.1:{port}", root, owns, proc)
        try:
            processes.wait_until(server.is_ready, what="prometheus", proc=proc, log_path=log,
                                 timeout=timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def reload(self, jobs: Mapping[str, Sequence[str]]) -> None:
        """Replace the scrape targets of the running server."""
        (self.data_dir / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(jobs)))
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def query(self, promql: str) -> list[Sample]:
        """Evaluate an instant query; raises ValueError with Prometheus' message if it fails."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body["status"] != "success":
            raise ValueError(f"query {promql!r} failed: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [Sample({}, float(data["result"][1]))]
        return [Sample(item["metric"], float(item["value"][1])) for item in data["result"]]

    def wait_for(
        self, promql: str, until: Callable[[list[Sample]], bool] = bool, timeout: float = 30.0,
    ) -> list[Sample]:
        """Query repeatedly until the result satisfies `until` (by default: is non-empty)."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.query(promql)
            if until(samples):
                return samples
            if time.monotonic() > deadline:
                raise TimeoutError(f"{promql!r} still gives {samples} after {timeout:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self._proc is not None:
            processes.stop_group(self._proc)
            self._proc = None
        if self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
