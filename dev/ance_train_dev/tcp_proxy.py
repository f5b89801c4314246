"""A loopback TCP proxy that a test or a benchmark can cut or slow down, to make a real server
unreachable or slow for a while (the fault tests, ``bench/chaos.py``).

Clients connect to ``127.0.0.1:<proxy.port>``; each connection is forwarded to the target by
two pump threads. :meth:`TcpProxy.cut` resets every open connection (RST, through
``SO_LINGER`` 0) and from then on resets every new connection right after accepting it, until
:meth:`TcpProxy.restore`. :meth:`TcpProxy.slow` delays every chunk forwarded in either
direction (on open connections too) until :meth:`TcpProxy.fast`. The target server itself is
never touched, so a server that keeps its state in memory (moto) loses nothing.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

_LINGER_RESET = struct.pack("ii", 1, 0)  # l_onoff=1, l_linger=0: close() sends RST


def _reset(sock: socket.socket) -> None:
    """Tear ``sock`` down abortively: wake a thread blocked in ``recv`` on it (shutdown), then
    close with ``SO_LINGER`` 0 so that the peer gets a reset."""
    with suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class TcpProxy:
    """Forward 127.0.0.1:port to ``target``; :meth:`cut` and :meth:`restore` the link."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self._delay_s = 0.0
        self.forwarded = 0  # connections forwarded to the target
        self.rejected = 0  # connections reset while cut
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def cut(self) -> None:
        """Reset every open connection and every new one until :meth:`restore`."""
        with self._lock:
            self._cut = True
            victims, self._open = self._open, set()
        for sock in victims:
            _reset(sock)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def slow(self, delay_s: float) -> None:
        """Hold every chunk (up to 64 KiB) ``delay_s`` before forwarding it, until :meth:`fast`."""
        self._delay_s = delay_s

    def fast(self) -> None:
        self._delay_s = 0.0

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                cut = self._cut
                if cut:
                    self.rejected += 1
            if cut:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self.forwarded += 1
                self._open.update((client, upstream))
            pumps = [threading.Thread(target=self._pump, args=pair, daemon=True)
                     for pair in ((client, upstream), (upstream, client))]
            for pump in pumps:
                pump.start()
            threading.Thread(target=self._close_after, args=(pumps, client, upstream),
                             daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if delay_s := self._delay_s:
                    time.sleep(delay_s)
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)  # pass the half-close on
        except OSError:
            # One side failed (or was cut): take the other side down too.
            for sock in (source, sink):
                self._discard(sock, abort=True)

    def _close_after(self, pumps: list[threading.Thread], *socks: socket.socket) -> None:
        for pump in pumps:
            pump.join()
        for sock in socks:
            self._discard(sock, abort=False)

    def _discard(self, sock: socket.socket, abort: bool) -> None:
        with self._lock:
            if sock not in self._open:
                return
            self._open.discard(sock)
        if abort:
            _reset(sock)
        else:
            sock.close()


@contextmanager
def tcp_proxy(target_host: str, target_port: int) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port).start()
    try:
        yield proxy
    finally:
        proxy.close()
