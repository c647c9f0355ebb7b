"""The colocated step's go-ahead line (``engines.ipc.go_ahead``): a worker told apply or skip for its step,
earlier steps' words passed over, and every way the line can fail ending the worker's wait loudly and
at once (a closed trainer end, a timeout, words out of step), a stranger's connection never taken for
the worker's."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest
from conftest import REPO
from local_strangers import Stranger

from mbridge_refit.engines.ipc.go_ahead import GO_AHEAD_VERSION, GoAheadError, GoAheadLine, GoAheadWaiter


def _connected(timeout_s: float = 5.0) -> tuple[GoAheadLine, GoAheadWaiter]:
    line = GoAheadLine.listen()
    waiter = GoAheadWaiter.connect(line.offer(timeout_s))
    line.accept(2.0)
    return line, waiter


def test_the_worker_hears_apply_or_skip_for_its_own_step():
    line, waiter = _connected()
    try:
        line.send(1, True)
        assert waiter.wait(1) is True
        line.send(2, False)
        assert waiter.wait(2) is False
        line.send(3, True)  # a step whose apply failed before its worker waited
        line.send(4, False)
        assert waiter.wait(4) is False
    finally:
        line.close()
        waiter.close()


def test_a_word_for_a_later_step_is_refused_as_out_of_step():
    line, waiter = _connected()
    try:
        line.send(6, True)
        with pytest.raises(GoAheadError, match="names step 6"):
            waiter.wait(5)
    finally:
        line.close()
        waiter.close()


def test_a_closed_trainer_end_ends_the_wait_at_once():
    line, waiter = _connected(timeout_s=60.0)
    line.close()
    started = time.monotonic()
    with pytest.raises(GoAheadError, match="closed"):
        waiter.wait(1)
    assert time.monotonic() - started < 5.0
    waiter.close()


def test_no_word_within_the_offer_s_timeout_raises():
    line, waiter = _connected(timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(GoAheadError, match="within its timeout"):
        waiter.wait(1)
    assert 0.25 < time.monotonic() - started < 5.0
    line.close()
    waiter.close()


def test_a_stranger_s_connection_is_never_taken_for_the_worker_s():
    line = GoAheadLine.listen()
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(line.address)  # first in the queue, with the wrong token
    stranger.sendall(b"\0" * 16)
    waiter = GoAheadWaiter.connect(line.offer(5.0))
    try:
        line.accept(2.0)
        line.send(1, True)
        assert waiter.wait(1) is True
        stranger.settimeout(2.0)
        assert stranger.recv(16) == b""  # closed unanswered
    finally:
        stranger.close()
        line.close()
        waiter.close()


def test_accept_without_a_worker_gives_up_with_a_reason():
    line = GoAheadLine.listen()
    with pytest.raises(GoAheadError, match="no worker connected"):
        line.accept(0.2)
    with pytest.raises(GoAheadError, match="closed"):
        line.accept(0.2)  # stopped listening
    line.close()


@pytest.mark.parametrize(
    "offer",
    [
        [],
        {"version": GO_AHEAD_VERSION},
        {"version": GO_AHEAD_VERSION, "address": "zz", "token": "00" * 16, "timeout_s": 1.0},
        {"version": GO_AHEAD_VERSION, "address": b"/tmp/elsewhere".hex(), "token": "00" * 16, "timeout_s": 1.0},
        {"version": GO_AHEAD_VERSION, "address": b"\0mbridge-refit-go-00".hex(), "token": "00" * 8, "timeout_s": 1.0},
        {"version": GO_AHEAD_VERSION, "address": b"\0mbridge-refit-go-00".hex(), "token": "00" * 16, "timeout_s": -1},
        {"version": GO_AHEAD_VERSION, "address": b"\0mbridge-refit-go-00".hex(), "token": "00" * 16, "timeout_s": 1.0},
        {
            "version": GO_AHEAD_VERSION,
            "address": b"\0mbridge-refit-go-00".hex(),
            "pid": "1",
            "token": "00" * 16,
            "timeout_s": 1.0,
        },
    ],
)
def test_a_malformed_offer_is_refused_before_any_connection(offer):
    with pytest.raises(GoAheadError, match="malformed"):
        GoAheadWaiter.connect(offer)


def test_an_offer_to_no_line_is_unreachable():
    line = GoAheadLine.listen()
    offer = line.offer(1.0)
    line.close()
    with pytest.raises(GoAheadError, match="cannot reach"):
        GoAheadWaiter.connect(offer)


def test_the_worker_notes_each_word_s_way_and_its_wait():
    line, waiter = _connected()
    try:
        threading.Timer(0.05, line.send, args=(1, True)).start()
        assert waiter.wait(1) is True
        assert 0 <= waiter.last_wake_ms < 1000 and 40 <= waiter.last_waited_ms < 5000
    finally:
        line.close()
        waiter.close()


def test_words_nobody_reads_fill_the_line_and_raise_instead_of_blocking(monkeypatch):
    import mbridge_refit.engines.ipc.go_ahead as go_ahead

    monkeypatch.setattr(go_ahead, "_SEND_S", 0.2)
    line, waiter = _connected()
    try:
        started = time.monotonic()
        with pytest.raises(GoAheadError, match="failed"):
            for step in range(1, 1_000_000):  # a worker whose applies fail before they wait reads none
                line.send(step, True)
        assert time.monotonic() - started < 30
    finally:
        line.close()
        waiter.close()


_TRAINER_THAT_FORKS_AND_DIES = """
import json, os, sys, time
from mbridge_refit.engines.ipc.go_ahead import GoAheadLine
line = GoAheadLine.listen()
print(json.dumps(line.offer(30.0)), flush=True)
line.accept(10.0)
if os.fork() == 0:  # a data loader's worker: outlives the trainer
    time.sleep(20)
    os._exit(0)
os._exit(1)  # the trainer dies without closing anything
"""


def test_a_dead_trainer_ends_the_wait_at_once_though_its_forked_child_lives():
    import json
    import subprocess
    import sys

    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER_THAT_FORKS_AND_DIES], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        waiter = GoAheadWaiter.connect(json.loads(trainer.stdout.readline()))
        trainer.wait(timeout=30)
        started = time.monotonic()
        with pytest.raises(GoAheadError, match="closed"):
            waiter.wait(1)
        assert time.monotonic() - started < 5.0
        waiter.close()
    finally:
        trainer.kill()


def _offer_token(line: GoAheadLine) -> bytes:
    return bytes.fromhex(line.offer(1.0)["token"])


def _the_word_arrives(line: GoAheadLine, waiter: GoAheadWaiter) -> None:
    line.send(1, True)
    assert waiter.wait(1) is True


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to fork a child that becomes another user (nobody, 65534)")
def test_a_connection_of_another_uid_is_refused_unread_though_it_sends_the_token(caplog):
    """Another user's process, first in the queue and holding the token itself (a leak: the uid alone keeps
    it out), is closed with its bytes unread, named in a warning; the worker's connection is the one taken."""
    stranger = Stranger(uid=65534)
    line = GoAheadLine.listen()
    waiter = None
    try:
        with caplog.at_level(logging.WARNING, logger="mbridge_refit.engines.ipc.go_ahead"):
            assert stranger.connect(line.address, [_offer_token(line)]) == 1
            waiter = GoAheadWaiter.connect(line.offer(2.0))
            line.accept(2.0)  # no pid given: the uid is what refuses the stranger
            _the_word_arrives(line, waiter)
        assert stranger.outcomes() == ["unread"]
        assert f"from pid {stranger.pid} (uid 65534): not this trainer's uid {os.geteuid()}" in caplog.text
    finally:
        stranger.close()
        line.close()
        if waiter is not None:
            waiter.close()


def test_a_connection_of_another_pid_is_refused_once_the_worker_s_pid_is_known(caplog, monkeypatch):
    """Processes of this uid that are not the worker, both holding the token (a leak): one queued before the
    worker's pid is known is refused when ``accept`` learns it; one connecting while ``accept`` waits for the
    worker's token is closed unread. The worker's connection is taken, though it came after the first."""
    import mbridge_refit.engines.ipc.go_ahead as go_ahead

    monkeypatch.setattr(go_ahead, "_TOKEN_WAIT_S", 5.0)  # the worker's token comes in two halves, the stranger between
    before, after = Stranger(), Stranger()
    line = GoAheadLine.listen()
    token = _offer_token(line)
    worker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # this process: the pid accept is given
    try:
        with caplog.at_level(logging.WARNING, logger="mbridge_refit.engines.ipc.go_ahead"):
            assert before.connect(line.address, [token]) == 1
            gate, accepted = line._gate, []
            _until(lambda: gate._proven, "the gate read the first stranger's token")  # else it goes unread
            worker.connect(line.address)
            worker.sendall(token[:8])
            accepting = threading.Thread(target=lambda: accepted.append(_accepting(line, os.getpid())))
            accepting.start()
            deadline = time.monotonic() + 5.0
            while gate._peer_pid is None and time.monotonic() < deadline:
                time.sleep(0.01)  # accept knows the worker's pid now, and waits for the rest of its token
            assert after.connect(line.address, [token]) == 1
            worker.sendall(token[8:])
            accepting.join(10.0)
            assert accepted == [None]
            line.send(7, True)
            worker.settimeout(2.0)
            assert worker.recv(64)[:9] == (7).to_bytes(8, "little") + b"\1"
        assert before.outcomes() == ["read"] and after.outcomes() == ["unread"]
        assert f"pid {before.pid} (uid {os.geteuid()}): it sent the token, but the engine worker is pid" in caplog.text
        assert f"pid {after.pid} (uid {os.geteuid()}): not the engine worker's pid {os.getpid()}" in caplog.text
    finally:
        for stranger in (before, after):
            stranger.close()
        worker.close()
        line.close()


def _until(condition, what: str, timeout_s: float = 5.0) -> None:
    """Wait for the gate's thread (a slow host's scheduler decides when it runs)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.01)


def _accepting(line: GoAheadLine, peer_pid: int) -> BaseException | None:
    try:
        line.accept(5.0, peer_pid=peer_pid)
    except BaseException as err:  # noqa: BLE001 - handed to the test's thread
        return err
    return None


_FLOOD_BOUND_S = 1.0  # the worker's connect and the trainer's accept under a flood (without the gate: 5 s, refused)
_QUEUE = 17  # more connections than a listen queue of 16 holds


@pytest.mark.parametrize("strangers", [15, 64])
def test_a_flood_of_silent_or_wrong_connections_neither_holds_off_nor_delays_the_worker(strangers):
    """A stranger of this uid queues ``strangers`` connections before the worker's (silent ones, wrong tokens,
    short ones): the worker still connects, ``accept`` takes it within the bound (neither a silent
    connection's 0.2 s each nor a full queue holding the worker's ``connect``), and its word arrives."""
    stranger = Stranger()
    line = GoAheadLine.listen()
    waiter = None
    try:
        kinds = [None, b"\0" * 16, b"\1" * 3]  # silent, a wrong token, a short one then silent
        connected = stranger.connect(line.address, [kinds[i % 3] for i in range(strangers)])
        started = time.monotonic()
        waiter = GoAheadWaiter.connect(line.offer(2.0))
        line.accept(_FLOOD_BOUND_S)  # the worker's pid unknown: the stranger's tokens are read
        took = time.monotonic() - started
        _the_word_arrives(line, waiter)
        assert took < _FLOOD_BOUND_S and connected == strangers, (took, connected)
        assert set(stranger.outcomes()) <= {"unread", "read"}  # none kept
    finally:
        stranger.close()
        line.close()
        if waiter is not None:
            waiter.close()


def test_a_flood_that_goes_on_while_the_worker_connects_does_not_keep_it_out():
    """Silent connections opened without pause, hundreds held open, while the worker connects: the line
    takes the worker's within the bound, and the flood meets a closed name afterwards."""
    stranger = Stranger()
    line = GoAheadLine.listen()
    waiter = None
    try:
        stranger.flood(line.address, seconds=1.5, held=256)
        time.sleep(0.3)  # the flood runs
        started = time.monotonic()
        waiter = GoAheadWaiter.connect(line.offer(2.0))
        line.accept(_FLOOD_BOUND_S)
        took = time.monotonic() - started
        _the_word_arrives(line, waiter)
        assert took < _FLOOD_BOUND_S, took
        flooded = stranger.flooded()
        assert flooded["opened"] > _QUEUE and flooded["failed"] > 0, flooded  # it flooded; then refused
    finally:
        stranger.close()
        line.close()
        if waiter is not None:
            waiter.close()


def test_accept_fails_at_once_where_the_worker_s_own_connection_was_refused():
    """The worker's pid known: its connection refused (a wrong token here), or none of that pid on the line
    once the queue is taken, ends ``accept`` at once with the reason, not after its timeout."""
    line = GoAheadLine.listen()
    mistaken = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        mistaken.connect(line.address)
        mistaken.sendall(b"\0" * 16)
        started = time.monotonic()
        with pytest.raises(GoAheadError, match=rf"pid {os.getpid()}\) was refused: a wrong token"):
            line.accept(10.0, peer_pid=os.getpid())
        assert time.monotonic() - started < 2.0
    finally:
        mistaken.close()
        line.close()
    line = GoAheadLine.listen()
    waiter = GoAheadWaiter.connect(line.offer(2.0))  # this process's pid, not the one named below
    try:
        started = time.monotonic()
        with pytest.raises(GoAheadError, match="no connection of that pid is on the line"):
            line.accept(10.0, peer_pid=os.getppid())
        assert time.monotonic() - started < 2.0
    finally:
        waiter.close()
        line.close()


def test_the_worker_sends_its_token_only_to_the_trainer_s_listener():
    """A name bound by a process that is not the offer's trainer (here this one, the offer naming another
    pid): the worker refuses it by name, and the listener never receives the token."""
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = "\0mbridge-refit-go-" + "5e" * 8
    squatter.bind(address)
    squatter.listen(1)
    offer = {"version": GO_AHEAD_VERSION, "address": address.encode().hex(), "pid": os.getppid()}
    offer |= {"token": "ab" * 16, "timeout_s": 1.0}
    try:
        with pytest.raises(
            GoAheadError, match=rf"listener is pid {os.getpid()} .*not the trainer's pid {os.getppid()}"
        ):
            GoAheadWaiter.connect(offer)
        connection, _ = squatter.accept()
        connection.settimeout(1.0)
        assert connection.recv(16) == b""
        connection.close()
    finally:
        squatter.close()


@pytest.mark.parametrize("version", [None, GO_AHEAD_VERSION + 1, str(GO_AHEAD_VERSION), True])
def test_an_offer_of_another_version_is_refused_by_name(version):
    line = GoAheadLine.listen()
    offer = line.offer(1.0)
    if version is None:
        del offer["version"]
    else:
        offer["version"] = version
    try:
        with pytest.raises(GoAheadError, match=rf"this worker speaks version {GO_AHEAD_VERSION}: install the same"):
            GoAheadWaiter.connect(offer)
    finally:
        line.close()


@pytest.mark.parametrize("version", [None, GO_AHEAD_VERSION + 1])
def test_an_offer_of_another_version_is_refused_by_its_version_before_its_fields_are_read(version):
    """An offer of another version need not have this version's fields (here its token is named
    otherwise): the worker names the version, not a malformed offer."""
    line = GoAheadLine.listen()
    offer = line.offer(1.0)
    offer["secret"] = offer.pop("token")
    del offer["version"]
    if version is not None:
        offer["version"] = version
    try:
        with pytest.raises(GoAheadError, match=rf"this worker speaks version {GO_AHEAD_VERSION}: install the same"):
            GoAheadWaiter.connect(offer)
    finally:
        line.close()


def test_the_offer_names_its_version_and_the_trainer_s_pid():
    line = GoAheadLine.listen()
    offer = line.offer(1.0)
    line.close()
    assert offer["version"] == GO_AHEAD_VERSION and offer["pid"] == os.getpid()
