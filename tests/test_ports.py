"""The loopback port picker used by the embedded launcher and the tests."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest

from ance_train.launcher import ports

from ance_train_dev.servers import use_worker_port_range, worker_port_range


def test_picked_ports_lie_below_the_ephemeral_range_and_are_bindable() -> None:
    low = ports.ephemeral_port_low()
    assert low == int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked), "a port is handed out once per process"
    for port in picked:
        assert ports.LOWEST_PICKED_PORT <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen(1)
        taken_port = taken.getsockname()[1]
        other = ports.free_port()
        monkeypatch.setattr(ports, "_handed_out", set())  # both offers are new to the picker
        offers = iter([taken_port, taken_port, other])
        monkeypatch.setattr(ports.random, "randrange", lambda _lo, _hi: next(offers))
        assert ports.free_port() == other


def test_a_port_handed_out_before_is_not_offered_again(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = ports.free_port(), ports.free_port()
    monkeypatch.setattr(ports, "_handed_out", {first})  # nothing listens on either yet
    offers = iter([first, first, second])
    monkeypatch.setattr(ports.random, "randrange", lambda _lo, _hi: next(offers))
    assert ports.free_port() == second


def test_without_room_below_the_ephemeral_range_the_kernel_picks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ports.PORT_RANGE_ENV, raising=False)  # set in xdist workers
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
    assert ports.ephemeral_port_low() == 1024
    port = ports.free_port()
    assert port >= 1024
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_an_unreadable_range_file_means_the_linux_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_port_low() == ports.DEFAULT_EPHEMERAL_LOW
    (tmp_path / "garbled").write_text("not a number")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "garbled")
    assert ports.ephemeral_port_low() == ports.DEFAULT_EPHEMERAL_LOW


def test_picks_stay_in_the_range_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    low = ports.ephemeral_port_low() - 500
    monkeypatch.setenv(ports.PORT_RANGE_ENV, f"{low}-{low + 50}")
    monkeypatch.setattr(ports, "_handed_out", set())
    assert ports.picked_range() == (low, low + 50)
    picked = [ports.free_port() for _ in range(20)]
    assert len(set(picked)) == 20 and all(low <= port < low + 50 for port in picked)


@pytest.mark.parametrize("value", ["10000", "20000-10000", "a-b", "0-100", "10000-70000"])
def test_a_malformed_range_is_an_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ports.PORT_RANGE_ENV, value)
    with pytest.raises(ValueError, match=ports.PORT_RANGE_ENV):
        ports.free_port()


def test_parallel_test_workers_get_disjoint_slices() -> None:
    span = (10000, 32768)
    slices = [worker_port_range(span, index, 3) for index in range(3)]
    assert slices[0][0] == 10000 and all(high <= 32768 for _, high in slices)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(slices))
    assert worker_port_range(None, 0, 2) is None
    assert worker_port_range((10000, 10150), 1, 2) is None  # too small to share


def test_an_xdist_worker_picks_from_its_own_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ports.PORT_RANGE_ENV, raising=False)
    low, high = ports.picked_range()
    environ = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    use_worker_port_range(environ)
    middle = low + (high - low) // 2
    assert environ[ports.PORT_RANGE_ENV] == f"{middle}-{middle + (high - low) // 2}"
    plain: dict[str, str] = {}
    use_worker_port_range(plain)  # not an xdist worker: the whole range, as before
    assert plain == {}
    monkeypatch.setenv(ports.PORT_RANGE_ENV, environ[ports.PORT_RANGE_ENV])
    monkeypatch.setattr(ports, "_handed_out", set())
    assert middle <= ports.free_port() < high
