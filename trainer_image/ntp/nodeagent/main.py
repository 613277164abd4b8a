"""`python -m ntp.nodeagent`: the node agent's command line, where its reports go, its metrics
server, and the run until the job ends."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from ntp.nodeagent import metrics
from ntp.nodeagent.agent import (
    AgentError,
    Devices,
    DirectorySource,
    Generations,
    NodeAgent,
    cuda_devices,
    write_atomic,
)
from ntp.nodeagent.heartbeat import Settings
from ntp.nodeagent.progress import NodeProgress
from tessera_contracts.invocation import (
    AgentInvocation,
    InvocationError,
    agent_parser,
)
from tessera_contracts.progress import NodeReport, report_key

log = logging.getLogger("ntp.nodeagent.agent")


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str], env: Mapping[str, str] = os.environ
               ) -> tuple[str, AgentInvocation]:
    """This node's name (`--node`, else NODE_NAME in `env`) and the agent's invocation. A
    command line that does not follow the contract ends the agent with its usage (status 2)."""
    try:
        invocation = AgentInvocation.from_args(argv)
        node = invocation.node or env.get("NODE_NAME")
        if not node:
            raise InvocationError("--node (or NODE_NAME) is required")
    except InvocationError as exc:
        agent_parser().error(str(exc))
    return node, invocation


def report_file(directory: Path) -> Callable[[NodeReport], None]:
    """Writes a node's report to `directory/<node>.json`, atomically."""

    def write(report: NodeReport) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / report_key(report.node), report.to_json())

    return write


def serve_metrics(progress: NodeProgress, addr: str, port: int, labels: Mapping[str, str]
                  ) -> None:
    """The node's goodput metrics, training and held-out loss at http://addr:port/metrics; a
    port that cannot be had is logged, not fatal (training matters more than its metrics)."""
    try:
        server = metrics.serve(progress.ledger, addr, port, labels, lambda: progress.loss,
                               progress.step_times, lambda: progress.eval_loss)
    except OSError as exc:
        log.error("no metrics: cannot serve on %s:%d: %s", addr, port, exc)
        return
    log.info("metrics on http://%s:%d/metrics", addr, server.server_port)


def main(argv: list[str] | None = None) -> int:
    node, opts = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # SIGTERM (the pod is deleted) runs the cleanup that kills the ranks, as PDEATHSIG would.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    devices = Devices.from_env(os.environ)
    devices.release_inherited()
    try:
        source: Generations
        if opts.generations is not None:
            source = DirectorySource(opts.generations)
            job = opts.job or opts.generations.resolve().parent.name
            publish = report_file(opts.generations.resolve().parent / "progress")
        else:
            from ntp.nodeagent import kube_source

            assert opts.job is not None  # the invocation has --job or --generations
            try:
                api, namespace = kube_source.connect(opts.namespace)
            except kube_source.SourceError as exc:
                raise AgentError(str(exc)) from None
            job = opts.job
            source = kube_source.KubeGenerationSource(api, namespace, job).start()
            publish = kube_source.progress_writer(api, namespace, job)
        try:
            heartbeat = Settings.from_env(os.environ)
        except ValueError as exc:
            raise AgentError(str(exc)) from None
        work_dir = opts.work_dir or Path(tempfile.mkdtemp(prefix="ntp-agent-"))
        work_dir.mkdir(parents=True, exist_ok=True)
        agent = NodeAgent(node, source, work_dir, opts.until_step, opts.trainer_args,
                          devices, publish, cuda_count=cuda_devices(), heartbeat=heartbeat)
        if opts.metrics_port:
            serve_metrics(agent.progress, os.environ.get("POD_IP") or "0.0.0.0",
                          opts.metrics_port, {"ntpjob": job, "node": node})
        return agent.run()
    except AgentError as exc:
        print(f"ntp.nodeagent: {node}: {exc}", file=sys.stderr)
        return 1
