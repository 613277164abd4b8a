"""`tessera operator`: run the Tessera operator (kopf, in this process) until SIGTERM or SIGINT;
with `--leader-elect`, only while this replica holds the leader Lease (`leader`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tessera_operator import leader

# Leader election's durations: controller-runtime's defaults.
LEASE_S, RENEW_DEADLINE_S, RETRY_S = 15.0, 10.0, 2.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tessera operator",
        description="Reconcile NTPTrainingJobs: GPU health -> layout plan -> status, layout "
                    "ConfigMap and GPU power targets.")
    p.add_argument("--kubeconfig", type=Path,
                   help="kubeconfig file (default: in-cluster service account, else $KUBECONFIG)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", metavar="NS",
                       help="watch NTPTrainingJobs in this namespace (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true",
                       help="watch NTPTrainingJobs in every namespace (the default)")
    p.add_argument("--liveness", metavar="URL",
                   help="serve kopf's liveness probe on this address only, e.g. "
                        "http://$POD_IP:8080/healthz")
    p.add_argument("--metrics-addr", default="0.0.0.0",
                   help="serve /metrics, /readyz and /healthz on this address (default: all)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="... and this port (the Deployment's: 9404; default 0: none)")
    elect = p.add_argument_group("leader election (a coordination.k8s.io Lease)")
    elect.add_argument("--leader-elect", action="store_true",
                       help="reconcile only while holding the Lease tessera-operator, so "
                            "replicas can stand by")
    elect.add_argument("--leader-elect-namespace", default=os.environ.get("POD_NAMESPACE"),
                       metavar="NS", help="the Lease's namespace (default: $POD_NAMESPACE)")
    elect.add_argument("--leader-elect-identity", metavar="ID",
                       default=os.environ.get("POD_NAME")
                       or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}",
                       help="this replica's name in the Lease (default: $POD_NAME, else the "
                            "host name and a random suffix)")
    elect.add_argument("--leader-elect-lease-duration", type=float, default=LEASE_S,
                       metavar="S", help="how long a standby waits after the holder's last "
                                         f"renewal (default {LEASE_S:g})")
    elect.add_argument("--leader-elect-renew-deadline", type=float, default=RENEW_DEADLINE_S,
                       metavar="S", help="how long the leader keeps trying to renew before it "
                                         f"exits (default {RENEW_DEADLINE_S:g})")
    elect.add_argument("--leader-elect-retry-period", type=float, default=RETRY_S,
                       metavar="S", help="between two tries to take or renew the Lease "
                                         f"(default {RETRY_S:g})")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    return p


def _bad_setting(args: argparse.Namespace, timing: leader.Timing) -> str | None:
    """Why the command line cannot run, naming the flag; None when it can."""
    if not 0 <= args.metrics_port <= 65535:
        return f"--metrics-port must be a port number (0 serves none), got {args.metrics_port}"
    if args.leader_elect and not args.leader_elect_namespace:
        return "--leader-elect needs --leader-elect-namespace or $POD_NAMESPACE"
    return timing.problem() if args.leader_elect else None


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.kubeconfig is not None:
        if not args.kubeconfig.is_file():
            print(f"tessera operator: no kubeconfig at {args.kubeconfig}", file=sys.stderr)
            return 2
        # kopf's login and the handlers' client both read it from here.
        os.environ["KUBECONFIG"] = str(args.kubeconfig.resolve())
    # Imported once $KUBECONFIG is final: the kubernetes client reads it at its import.
    from tessera_operator import leader

    timing = leader.Timing(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                           args.leader_elect_retry_period)
    problem = _bad_setting(args, timing)
    if problem is not None:
        print(f"tessera operator: {problem}", file=sys.stderr)
        return 2
    # Imported late: registering the handlers is a side effect of importing them.
    import kopf

    from tessera_operator import handlers, metrics, settings  # noqa: F401

    # Timestamped lines: how long a reaction took can be read from the log.
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.FULL)
    # Until kopf takes the signals over, a signal stops this (and kopf, at its start).
    stop, started = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    @kopf.on.startup()
    def stopping_already(**_: Any) -> None:
        if stop.is_set():
            signal.raise_signal(signal.SIGTERM)

    elector = leader.Elector(settings.api_client(), args.leader_elect_namespace,
                             args.leader_elect_identity, timing) if args.leader_elect else None

    def ready() -> bool:
        """Leading with kopf's watches started, or standing by with the Lease readable."""
        if started.is_set():
            return True
        return elector is not None and not elector.leading and elector.healthy()

    def live() -> bool:
        """kopf's own liveness while it runs (its event loop answers); a standby is alive
        while this answers (an API server away is no reason to restart it)."""
        return not started.is_set() or args.liveness is None or metrics.responds(args.liveness)

    stop_serving = metrics.serve(args.metrics_addr, args.metrics_port, ready, live) \
        if args.metrics_port else None
    try:
        if elector is not None:
            if not elector.acquire(stop):
                return 0
            elector.keep(_lost)
        metrics.LEADER.set(1)
        # kopf stops cleanly on SIGTERM/SIGINT: handlers finish, watches close, then it
        # returns. `started` is set once its startup handlers ran, which starts its watches.
        kopf.run(standalone=True, clusterwide=not args.namespace,
                 namespaces=args.namespace or (), liveness_endpoint=args.liveness,
                 ready_flag=started)
    finally:
        started.clear()
        if elector is not None:
            elector.release()  # after kopf stopped: the next leader never overlaps this one
        if stop_serving is not None:
            stop_serving()
    return 0


def _lost() -> None:
    """The Lease may go to another replica any moment now: stop at once, reconciles in flight
    included (their writes are idempotent, the next leader re-observes); the Deployment
    restarts this one as a standby."""
    logging.getLogger(__name__).error("exiting: leadership lost")
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
