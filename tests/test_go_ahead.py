"""The colocated step's go-ahead line (``engines.go_ahead``): a worker told apply or skip for its step,
earlier steps' words passed over, and every way the line can fail ending the worker's wait loudly and
at once (a closed trainer end, a timeout, words out of step), a stranger's connection never taken for
the worker's."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from conftest import REPO

from mbridge_refit.engines.go_ahead import GoAheadError, GoAheadLine, GoAheadWaiter


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
        {},
        {"address": "zz", "token": "00" * 16, "timeout_s": 1.0},
        {"address": b"/tmp/elsewhere".hex(), "token": "00" * 16, "timeout_s": 1.0},
        {"address": b"\0mbridge-refit-go-00".hex(), "token": "00" * 8, "timeout_s": 1.0},
        {"address": b"\0mbridge-refit-go-00".hex(), "token": "00" * 16, "timeout_s": -1},
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
    import mbridge_refit.engines.go_ahead as go_ahead

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
from mbridge_refit.engines.go_ahead import GoAheadLine
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
