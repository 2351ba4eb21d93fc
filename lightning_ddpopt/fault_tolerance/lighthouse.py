"""The Lighthouse: torchft's quorum server, started by ``ddpopt lighthouse``, and the check that one answers.

One Lighthouse serves a whole run: every island's manager sends it heartbeats and asks it for each step's quorum.
It holds no training state, so it can run anywhere the islands reach (a login node, the first job's host).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable

from lightning_ddpopt.fault_tolerance.config import lighthouse_host_port, require_torchft

__all__ = ["check_reachable", "serve"]


def check_reachable(address: str, timeout_s: float) -> None:
    """Raise ``ConnectionError`` naming ``address`` unless a server accepts a connection there within ``timeout_s``.

    torchft's manager would retry for its whole connect timeout and then fail deep inside; this says at setup
    which address did not answer and how to start a Lighthouse there.
    """
    host, port = lighthouse_host_port(address, "lighthouse")
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            pass
    except OSError as error:
        raise ConnectionError(
            f"no Lighthouse answers at {address} ({error}): start one on that host with "
            "`ddpopt lighthouse --port PORT --min-replicas N`, or pass its address in FaultTolerance(lighthouse=...)"
        ) from error


def serve(
    port: int,
    min_replicas: int,
    join_timeout_ms: int = 60000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5000,
    say: Callable[[str], None] = print,
    stop: threading.Event | None = None,
) -> None:
    """Run a Lighthouse on ``port`` (all interfaces) until SIGINT or SIGTERM (or ``stop`` is set).

    Args:
        port: the port to listen on (0: any free one, printed).
        min_replicas: islands a quorum needs; the first quorum forms once this many have joined.
        join_timeout_ms: how long a quorum waits, once ``min_replicas`` have asked, for the live islands that have
            not asked yet (a slow island is waited for; a lost one stops sending heartbeats and is not).
        quorum_tick_ms: how often the Lighthouse re-evaluates the quorum.
        heartbeat_timeout_ms: an island silent for this long is dropped from the next quorum.
        say: where the address and the shutdown are reported.
        stop: an event that stops the server (for callers that run it in a thread).
    """
    require_torchft()
    # torchft's Rust side logs every quorum at INFO (lines a step); a user's RUST_LOG still decides.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
    say(f"ddpopt: Lighthouse at {server.address()} (min_replicas={min_replicas}); stop with Ctrl-C")
    try:
        while not stop.wait(0.5):  # woken often: the signal handlers run between waits
            pass
    finally:
        server.shutdown()
        say("ddpopt: Lighthouse stopped")
