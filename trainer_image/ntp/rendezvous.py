"""The job's rendezvous (`python -m ntp.rendezvous --host ADDR --port P`): hosts its TCPStore,
nothing else.

The store outlives every rank and every node agent, so losing any of them cannot take the
rendezvous down. It listens on `--host` only (in a pod: its pod IP), so two jobs, or two local
clusters, on one machine each keep the same port to themselves. It prints one line when it
listens and exits 0 on SIGTERM (or SIGINT).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading

import torch.distributed as dist


def serve(host: str, port: int) -> dist.TCPStore:
    """The job's store, listening on `host`:`port` only (0: a free port, see `.port`).

    TCPStore's own server listens on every address whatever `host` says, so a store on one
    pod's address would answer clients of any other address with that port (another cluster's
    trainers among them); it is handed a socket bound to `host` instead (either backend,
    libuv or not, takes one)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    # SO_REUSEADDR (create_server sets it): a restarted rendezvous rebinds its port at once.
    listener = socket.create_server((host, port), family=family)
    bound = listener.getsockname()[1]
    # The store owns the descriptor from here (its server closes it).
    return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ntp.rendezvous", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free one)")
    opts = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not 0 <= opts.port <= 65535:
        parser.error(f"--port must be a TCP port, got {opts.port}")
    # Handled before the store starts, so a SIGTERM arriving at any point stops it cleanly.
    stopped: list[int] = []
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stopped.append(signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    try:
        store = serve(opts.host, opts.port)
    except (RuntimeError, OSError) as exc:
        print(f"ntp.rendezvous: cannot listen on {opts.host}:{opts.port}: {exc}", file=sys.stderr)
        return 1
    print(f"ntp.rendezvous: TCPStore listening on {opts.host}:{store.port}", flush=True)
    stop.wait()
    print(f"ntp.rendezvous: {signal.Signals(stopped[0]).name}, stopping", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
