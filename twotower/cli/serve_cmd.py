"""twotower serve: keep an index loaded behind an HTTP API, with a search page at /.

The index, its encoder and the reranker load once; concurrent queries are encoded
together (micro-batching) by one model-owner thread.  Endpoints: GET /search,
POST /search (a batch), POST/DELETE /documents, GET /documents/ID,
GET /health, GET /stats; the API reference is at /docs.

Binds 127.0.0.1 unless --host says otherwise.  Writes need a bearer token
(--token-file FILE or the TWOTOWER_TOKEN environment variable) and, with a
token set, so do reads; --read-only refuses writes (a token then guards reads alone).
docs/serve.md has the details.

SIGTERM or Ctrl-C (SIGINT) stops it gracefully, as uvicorn does: no new connections, the requests in flight
answered (those still running after 30 s are cancelled), then the model owner stopped; the server says so on
stderr, and uvicorn then re-raises the signal, so the exit status is the signal's (143 for SIGTERM), as a
supervisor expects of a process it stopped.
"""  # plain text, not reStructuredText: it is `twotower serve --help`'s description

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import math
import signal
import socket
import sys

from twotower.cli import CLIError
from twotower.cli.checks import index_directory, model_directory, positive, reranker_directory
from twotower.cli.help_format import DefaultsRawDescriptionHelpFormatter

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve an index over HTTP (JSON API + search page)",
                              description=__doc__, formatter_class=DefaultsRawDescriptionHelpFormatter)
    p.add_argument("--index", required=True, help="index directory built by `twotower index build`")
    p.add_argument("--reranker", help='cross-encoder directory, or "default" for the reranker twotower ships '
                                           "(default: the index's reranker, if any)")
    p.add_argument("--no-reranker", action="store_true", help="load no reranker, not even the index's default")
    p.add_argument("--model", help="query encoder directory if the index's model moved (must be the same model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; the default, 127.0.0.1, is reachable from this machine only")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--read-only", action="store_true",
                   help="refuse every write (POST/DELETE /documents); a token still guards reads")
    p.add_argument("--token-file", help="file whose first line is the bearer token for writes, and then for "
                                        "reads too (default: $TWOTOWER_TOKEN)")
    p.add_argument("--threads", type=int, help="torch/FAISS threads of the model owner (default: all cores in fp32, all but one with bf16)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="most queries encoded together; 4x as many may wait, more are refused (503)")
    p.add_argument("--batch-wait-ms", type=float, default=3.0, metavar="MS",
                   help="longest wait for more queries to fill a batch, in milliseconds")
    p.add_argument("--max-body-mb", type=float, default=4.0, metavar="MB", help="largest request body, in megabytes")
    p.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    p.set_defaults(func=run_serve)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise CLIError(f"--port {args.port}: must be between 1 and 65535")
    positive("--threads", args.threads)
    positive("--max-batch", args.max_batch)
    if not 0 <= args.batch_wait_ms < math.inf:  # written so that NaN fails too (every comparison with it is False)
        raise CLIError(f"--batch-wait-ms must be a number >= 0, got {args.batch_wait_ms:g}")
    if not 0 < args.max_body_mb < math.inf:
        raise CLIError(f"--max-body-mb must be a number > 0, got {args.max_body_mb:g}")
    if args.reranker and args.no_reranker:
        raise CLIError("give --reranker DIR or --no-reranker, not both")
    index_directory("--index", args.index)
    if args.reranker:
        reranker_directory("--reranker", args.reranker)
    if args.model:
        model_directory("--model", args.model, dual=True)
    try:
        import uvicorn

        from twotower.serve.app import ServeConfig, create_app
        from twotower.serve.auth import TOKEN_ENV, load_token
        from twotower.serve.limits import Limits
        from twotower.serve.server import uvicorn_config
    except ModuleNotFoundError as exc:
        raise CLIError(f"twotower serve needs {exc.name}: pip install 'twotower[serve]'") from None
    token = load_token(args.token_file)
    if not _is_loopback(args.host) and token is None:
        print(f"twotower serve: warning: serving on {args.host} without a token: anyone who can reach it may "
              f"search (writes stay disabled); set --token-file or {TOKEN_ENV}", file=sys.stderr)
    config = ServeConfig(
        index=args.index, model=args.model, reranker=args.reranker, use_default_reranker=not args.no_reranker,
        read_only=args.read_only, token=token, threads=args.threads, max_batch=args.max_batch,
        max_wait_ms=args.batch_wait_ms, limits=Limits(max_body_bytes=int(args.max_body_mb * 1024 * 1024)),
    )
    sock = _bind(args.host, args.port)  # before anything loads: a port in use is said at once, in flag words
    app = create_app(config)
    # uvicorn_config: a shutdown grace period, a connection bound, a deadline for request heads (twotower.serve.server)
    server = _server_class(uvicorn)(uvicorn_config(app, host=args.host, port=args.port, access_log=args.access_log,
                                                   log_level="info" if args.verbose else "warning", workers=1))
    owner = app.state.service.owner
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"twotower serve: {args.index} at http://{host}:{args.port}/ (API reference at /docs); loading the "
          "index and models…", file=sys.stderr, flush=True)

    def report_when_loaded() -> None:
        if owner.wait_ready():
            view = owner.view
            mode = "read-only" if args.read_only else ("writes with the token" if token else "writes disabled")
            print(f"twotower serve: ready: {view.documents:,} documents, generation {view.generation}, reranker "
                  f"{'loaded' if owner.reranker_loaded else 'none'}, {mode}", file=sys.stderr, flush=True)
        elif owner.state == "failed":
            print(f"twotower serve: error: {owner.error}", file=sys.stderr, flush=True)
            server.should_exit = True

    import threading

    threading.Thread(target=report_when_loaded, name="twotower-serve-ready", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 1 if owner.state == "failed" else 0


def _server_class(uvicorn) -> type:
    """uvicorn's `Server`, saying on stderr when a signal stops it and when it has stopped (it used to exit in
    silence).  uvicorn takes the signal in `Server.handle_exit` (installed by `Server.capture_signals` for the
    run) and shuts down gracefully in `Server.shutdown`, re-raising the signal only after it; both are extended
    here, not replaced, so that shutdown, its wait for the requests in flight and the exit status stay uvicorn's.
    The lines are written from `shutdown`, in the event loop, not from the signal handler, which may interrupt
    another write to stderr.  A subclass made here because uvicorn is imported only once serving is asked for."""

    class Server(uvicorn.Server):
        stop_signal: int | None = None  # the first signal that asked it to stop

        def handle_exit(self, sig: int, frame) -> None:
            if self.stop_signal is None:
                self.stop_signal = sig
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if self.stop_signal is None:  # not a signal: a failed load ends the run and says why itself
                return await super().shutdown(sockets=sockets)
            print(f"twotower serve: stopping ({signal.Signals(self.stop_signal).name}): finishing requests in "
                  "flight", file=sys.stderr, flush=True)
            await super().shutdown(sockets=sockets)
            print("twotower serve: stopped", file=sys.stderr, flush=True)

    return Server


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), as uvicorn would open it (SO_REUSEADDR), or a CLIError naming the
    flag: uvicorn found a port in use only after the models had loaded, and then said "error: None"."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise CLIError(f"--host {host}: not an address of this machine ({exc})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as exc:
        sock.close()
        why = "already in use (another server is listening there)" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise CLIError(f"--port {port}: cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock
