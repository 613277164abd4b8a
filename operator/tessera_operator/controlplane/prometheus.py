"""A Prometheus server on loopback with a generated scrape config, and a small query helper."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tessera_operator.controlplane import probes, processes

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

        def launch(ports: list[int]) -> Prometheus:
            log = root / "prometheus.log"
            # a test helper: the server dies with the process that started it, even on SIGKILL
            proc = processes.spawn([
                exe, f"--config.file={config}", f"--storage.tsdb.path={root / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{ports[0]}",
            ], log, die_with_parent=True)
            server = cls(f"http://127.0.0.1:{ports[0]}", root, owns, proc)
            try:
                processes.wait_until(server.is_ready, what="prometheus", proc=proc,
                                     log_path=log, timeout=timeout)
            except BaseException:
                processes.stop_group(proc)
                raise
            return server

        try:
            return processes.with_free_ports(1, launch)
        except BaseException:
            if owns:
                shutil.rmtree(root, ignore_errors=True)
            raise

    def is_ready(self) -> bool:
        return probes.responds(f"{self.url}/-/ready")

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
        return probes.poll_until(
            lambda: self.query(promql), until, timeout=timeout, interval=0.2,
            error=lambda samples: TimeoutError(
                f"{promql!r} still gives {samples} after {timeout:.0f} s"))

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
