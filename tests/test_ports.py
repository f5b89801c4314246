"""The loopback port picker used by the embedded launcher and the tests."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ance_train.launcher import ports


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
