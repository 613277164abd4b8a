"""`tessera operator`: run the Tessera operator (kopf, in this process) until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


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
    p.add_argument("--verbose", action="store_true", help="debug logging")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.kubeconfig is not None:
        if not args.kubeconfig.is_file():
            print(f"tessera operator: no kubeconfig at {args.kubeconfig}", file=sys.stderr)
            return 2
        # kopf's login and the handlers' client both read it from here.
        os.environ["KUBECONFIG"] = str(args.kubeconfig.resolve())
    # Imported late: registering the handlers is a side effect of importing them.
    import kopf

    from tessera_operator import handlers, settings  # noqa: F401

    # Timestamped lines: how long a reaction took can be read from the log.
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.FULL)
    # kopf stops cleanly on SIGTERM/SIGINT: handlers finish, watches close, then it returns.
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace or (),
             liveness_endpoint=args.liveness)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
