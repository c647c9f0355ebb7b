"""The packed broadcast over a ``StoreGroup`` on CPU (gloo), sender and receivers in threads of
this process (the trainer's death and stop in a child process): the collectives both ends issue,
the settings members must share, and failures that must reach every member within seconds.

Issue #31: into an engine on another GPU, NCCL failed in its bootstrap ("Message truncated:
received 12288 bytes instead of 512") because vLLM's batch-invariant mode had set
``NCCL_MAX_NCHANNELS=1`` (and more) in the engine's worker only, and the trainer then waited for
the group's timeout. The collective sequences of both ends were already identical (the first
test below shows it); the settings check and the failure channel are what the fix adds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, free_port
from test_packed_broadcast import _plan

from mbridge_refit.engines.broadcast import group as broadcast_group
from mbridge_refit.engines.broadcast.group import (
    STORE_PROTOCOL,
    GroupSetupError,
    PeerFailedError,
    SettingsMismatchError,
    StoreGroup,
    StoreProtocolError,
    group_settings,
    new_secret,
    settings_differences,
)
from mbridge_refit.engines.broadcast.packed import (
    WIRE_VERSION,
    ChecksumError,
    PackedBroadcastConfig,
    PackedBroadcastReceiver,
    PackedBroadcastSender,
    PlanMismatchError,
    RefitStatusError,
    SendBuffers,
    StreamPacking,
    WireVersionError,
)
from mbridge_refit.sinks.base import drain

PLAN = _plan(
    ("a", (3,), "bfloat16"),
    ("b", (10, 7), "float32"),
    ("c", (0,), "bfloat16"),
    ("d", (5,), "int8"),
    ("e", (), "float32"),
)
RENAMED = _plan(  # PLAN as a receiver of another model has it: its second entry named otherwise
    ("a", (3,), "bfloat16"),
    ("b.renamed", (10, 7), "float32"),
    ("c", (0,), "bfloat16"),
    ("d", (5,), "int8"),
    ("e", (), "float32"),
)
CONFIG = PackedBroadcastConfig(bucket_bytes=64, num_buffers=2, checksum=True)
BUCKETS = StreamPacking.build(PLAN, CONFIG.bucket_bytes).num_buckets
SECRET = new_secret()  # every group of these tests: its members are threads of this process (or its child)
GROUP_TIMEOUT_S = 45.0  # a wait the failure channel does not cut short lasts this long (> BOUND_S)
BOUND_S = 30.0  # what the issue asks: every member raises within this


class CorruptingReceiver(PackedBroadcastReceiver):
    """A receiver whose third bucket (bucket 2) arrives with its first byte changed, before its checksum."""

    def _checksum(self, bucket, data):
        if bucket == 2:
            data[:1].add_(1)
        super()._checksum(bucket, data)


def plan_tensors(plan, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for entry in plan.entries:
        values = torch.randn(entry.shape, generator=gen) * 10
        out.append((entry.hf_name, values.to(entry.torch_dtype)))
    return out


def run_members(*targets, join_s: float = 120.0) -> list:
    """Run ``targets[i](rank=i)`` in threads; each result is its return value or the exception it raised,
    with the seconds it took."""
    results: list = [None] * len(targets)

    def run(index: int) -> None:
        started = time.monotonic()
        try:
            value = targets[index](index)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            value = err
        results[index] = (value, time.monotonic() - started)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_s)
    assert all(r is not None for r in results), f"a member is still running after {join_s} s: {results}"
    return results


# --- the collectives each end issues ----------------------------------------------------------


class RecordingGroup:
    """A ``StoreGroup`` that records each collective it issues: (op, dtype, numel, src)."""

    def __init__(self, group: StoreGroup) -> None:
        self.inner, self.calls = group, []
        self.rank, self.device = group.rank, group.device

    def is_member(self) -> bool:
        return True

    def is_source(self, src: int) -> bool:
        return self.inner.is_source(src)

    def broadcast(self, tensor, src, *, async_op=False):
        self.calls.append(("broadcast", str(tensor.dtype), tensor.numel(), src))
        return self.inner.broadcast(tensor, src, async_op=async_op)

    def all_reduce(self, tensor, op):
        self.calls.append(("all_reduce", str(tensor.dtype), tensor.numel(), str(op)))
        return self.inner.all_reduce(tensor, op)

    def broadcast_object(self, obj, src, device):
        return StoreGroup.broadcast_object(self, obj, src, device)  # its size and payload broadcasts, recorded

    def post_error(self, message: str) -> None:
        self.calls.append(("post_error",))
        self.inner.post_error(message)


def _recorded_pair(receiver_plan, *, consumer_fails: bool = False, receiving: type = PackedBroadcastReceiver):
    """A sender of ``PLAN`` and a ``receiving`` receiver of ``receiver_plan`` over two recorded store
    groups: ``(their results, the sender's collectives, the receiver's)``."""
    port = free_port()
    groups: dict[int, RecordingGroup] = {}

    def join(rank: int) -> RecordingGroup:
        groups[rank] = RecordingGroup(
            StoreGroup(host="127.0.0.1", port=port, rank=rank, world_size=2, device="cpu", secret=SECRET)
        )
        return groups[rank]

    def send(rank: int):
        sender = PackedBroadcastSender(PLAN, CONFIG, group=join(rank), src=0, device="cpu")
        for name, tensor in plan_tensors(PLAN):
            sender.consume(name, tensor)
        sender.finish()

    def receive(rank: int):
        receiver = receiving(receiver_plan, CONFIG, group=join(rank), src=0, device="cpu")
        got = []
        for name, tensor in receiver.receive():
            if consumer_fails and len(got) == 1:
                raise ValueError("test consumer rejects the 2nd tensor")
            got.append((name, tensor.clone()))
        return got

    results = run_members(send, receive)
    for group in groups.values():
        group.inner.close()
    return results, groups[0].calls, groups[1].calls


def test_sender_and_receiver_issue_the_same_collectives():
    """Clean, plan mismatch, bad checksum, failing consumer: the two ends issue the same collectives,
    in the same order, of the same dtypes and sizes (guards the protocol; this held before the fix too)."""
    (sent, received), source, receiver = _recorded_pair(PLAN)
    assert sent[0] is None and [n for n, _ in received[0]] == list("abcde")
    assert BUCKETS > 3 and source == receiver
    assert len(source) == 2 + BUCKETS + 2  # header, verdict, per bucket its bytes, the checksums, status

    (sent, received), source, receiver = _recorded_pair(RENAMED)
    assert isinstance(sent[0], PlanMismatchError) and isinstance(received[0], PlanMismatchError)
    assert source == receiver and ("broadcast", "torch.uint8", source[3][2], 0) in source  # the signature's bytes

    (sent, received), source, receiver = _recorded_pair(PLAN, receiving=CorruptingReceiver)
    assert isinstance(sent[0], RefitStatusError) and isinstance(received[0], ChecksumError)
    assert source == receiver

    (sent, received), source, receiver = _recorded_pair(PLAN, consumer_fails=True)
    assert isinstance(sent[0], RefitStatusError) and isinstance(received[0], ValueError)
    assert source == receiver and ("post_error",) not in source + receiver  # settled by the protocol itself


def test_the_source_packs_its_first_bucket_before_the_receivers_come():
    """The source's constructor issues its header and returns: it packs the tensors of bucket 0 while no
    receiver has come to the handshake, and waits for the verdict only before that bucket goes out. (A
    source that waited in its constructor would hold the receiver back until BOUND_S, and this fails.)"""
    port, packed = free_port(), threading.Event()
    tensors = plan_tensors(PLAN)
    agree_at = SendBuffers(PLAN, CONFIG).agree_at
    assert agree_at == 1  # "a" lies in bucket 0, "b" reaches past it
    groups: dict[int, StoreGroup] = {}

    def join(rank: int) -> StoreGroup:
        groups[rank] = StoreGroup(host="127.0.0.1", port=port, rank=rank, world_size=2, device="cpu", secret=SECRET)
        return groups[rank]

    def send(rank: int):
        sender = PackedBroadcastSender(PLAN, CONFIG, group=join(rank), src=0, device="cpu")
        for name, tensor in tensors[:agree_at]:
            sender.consume(name, tensor)
        packed.set()
        for name, tensor in tensors[agree_at:]:
            sender.consume(name, tensor)
        sender.finish()

    def receive(rank: int):
        group = join(rank)
        came_after_packing = packed.wait(BOUND_S)
        receiver = PackedBroadcastReceiver(PLAN, CONFIG, group=group, src=0, device="cpu")
        return came_after_packing, [(name, tensor.clone()) for name, tensor in receiver.receive()]

    (sent, _), (received, _) = run_members(send, receive)
    for group in groups.values():
        group.close()
    assert sent is None and not isinstance(received, BaseException), (sent, received)
    came_after_packing, got = received
    assert came_after_packing, "the source's constructor waited for the receiver"
    assert [name for name, _ in got] == [name for name, _ in tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, tensors))


def _two_trainers_and_a_receiver(
    *, other_config=CONFIG, receiver_plan=PLAN, receiver_fails_in_handshake=False, source_buffers=None
):
    """The source and one more trainer rank iterate a collective export (an all-reduce per tensor over
    their own group, as a tensor-parallel export gathers) and share the verdict over a trainer group; one
    receiver. Each member's result (or error) with its seconds, and the receiver's tensors."""
    ports = {"refit": free_port(), "trainers": free_port(), "export": free_port()}
    groups: list[StoreGroup] = []
    tensors = plan_tensors(PLAN)

    def join(name: str, rank: int) -> StoreGroup:
        group = StoreGroup(
            host="127.0.0.1",
            port=ports[name],
            rank=rank,
            world_size=2,
            device="cpu",
            secret=SECRET,
            timeout=_seconds(GROUP_TIMEOUT_S),
        )
        groups.append(group)
        return group

    def export(group: StoreGroup):
        for name, tensor in tensors:
            group.all_reduce(torch.ones(1, dtype=torch.int64), torch.distributed.ReduceOp.SUM)
            yield name, tensor

    def trainer(rank: int, refit, config, buffers=None):
        trainers, gathers = join("trainers", rank), join("export", rank)
        sender = PackedBroadcastSender(
            PLAN, config, group=refit, src=0, trainer_group=trainers, trainer_src=0, device="cpu", buffers=buffers
        )
        drain(export(gathers), sender)

    def receive(rank: int):
        group = join("refit", 1)
        if receiver_fails_in_handshake:
            group.broadcast = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("injected handshake failure"))
        receiver = PackedBroadcastReceiver(receiver_plan, CONFIG, group=group, src=0, device="cpu")
        return [(name, tensor.clone()) for name, tensor in receiver.receive()]

    results = run_members(
        lambda rank: trainer(0, join("refit", 0), CONFIG, source_buffers),
        lambda rank: trainer(1, None, other_config),
        receive,
    )
    for group in groups:
        group.close()
    return results, tensors


def test_trainer_ranks_with_another_config_stay_in_step():
    """Only the source's config reaches the receivers; another trainer rank built its sender with another
    bucket size, so its own first entry past bucket 0 differs. Only the source takes the verdict mid-stream
    and the outcome is shared in ``finish``, so the ranks stay in step through the collective export (they
    deadlocked when each shared the verdict at its own entry)."""
    other = PackedBroadcastConfig(bucket_bytes=1024, num_buffers=2, checksum=True)
    assert SendBuffers(PLAN, other).agree_at != SendBuffers(PLAN, CONFIG).agree_at
    ((source, _), (second, _), (received, seconds)), tensors = _two_trainers_and_a_receiver(other_config=other)
    assert source is None and second is None, (source, second)
    assert seconds < BOUND_S and [name for name, _ in received] == [name for name, _ in tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(received, tensors))


def test_a_refused_handshake_reaches_every_trainer_rank_after_the_export():
    """A plan mismatch, and a receiver failing in its handshake: the source raises the mismatch or the
    receiver's failure, the other trainer rank ``RefitStatusError`` naming it, each after iterating the
    collective export to its end (else the other would wait in a gather), all within the bound."""
    ((source, s1), (second, s2), (received, s3)), _ = _two_trainers_and_a_receiver(receiver_plan=RENAMED)
    assert isinstance(source, PlanMismatchError) and isinstance(received, PlanMismatchError), (source, received)
    assert isinstance(second, RefitStatusError) and "PlanMismatchError" in str(second), second
    assert max(s1, s2, s3) < BOUND_S

    ((source, s1), (second, s2), (received, s3)), _ = _two_trainers_and_a_receiver(receiver_fails_in_handshake=True)
    assert "injected handshake failure" in str(source) and "injected handshake failure" in str(second), (source, second)
    assert isinstance(second, RefitStatusError) and "injected handshake failure" in str(received)
    assert max(s1, s2, s3) < BOUND_S


def test_the_sources_buffers_failing_reaches_every_member():
    """The source cannot allocate its buffers (its device is full): it raises that error, the other trainer
    rank ``RefitStatusError`` naming it after the collective export's end, the receiver ``PeerFailedError``,
    all within the bound (was: an ``IndexError`` on the source and the other rank waiting in a gather)."""
    buffers = SendBuffers(PLAN, CONFIG, "cpu")

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("injected: the source's device is full")

    buffers.allocate = full
    ((source, s1), (second, s2), (received, s3)), _ = _two_trainers_and_a_receiver(source_buffers=buffers)
    assert isinstance(source, torch.OutOfMemoryError), source
    assert isinstance(second, RefitStatusError) and "device is full" in str(second), second
    assert isinstance(received, PeerFailedError) and "device is full" in str(received), received
    assert max(s1, s2, s3) < BOUND_S


# --- settings members must share ------------------------------------------------------------------


VLLM_BATCH_INVARIANT_NCCL = {  # what vLLM's batch-invariant mode sets in its workers (vLLM 0.26)
    "NCCL_LAUNCH_MODE": "GROUP",
    "NCCL_COLLNET_ENABLE": "0",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_P2P_NET_DISABLE": "1",
    "NCCL_MIN_NCHANNELS": "1",
    "NCCL_MAX_NCHANNELS": "1",
    "NCCL_PROTO": "Simple",
    "NCCL_ALGO": "allreduce:tree",
    "NCCL_NTHREADS": "1",
    "NCCL_SOCKET_NTHREADS": "1",
}


def test_nccl_settings_are_the_communicator_shaping_variables():
    trainer = group_settings(
        "nccl", {"NCCL_NVLS_ENABLE": "0", "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "PATH": "/bin"}
    )
    assert trainer["nccl_env"] == {"NCCL_NVLS_ENABLE": "0"} and trainer["nccl_version"].count(".") == 2
    assert "nccl_env" not in group_settings("gloo", VLLM_BATCH_INVARIANT_NCCL)
    engine = group_settings("nccl", {**VLLM_BATCH_INVARIANT_NCCL, "NCCL_DEBUG": "WARN"})
    differences = settings_differences({0: trainer, 1: engine})
    assert "NCCL_MAX_NCHANNELS: member 0 <unset>, member 1 1" in differences
    assert "NCCL_PROTO: member 0 <unset>, member 1 Simple" in differences
    assert not any(d.startswith(("NCCL_NVLS_ENABLE", "NCCL_DEBUG", "nccl_version")) for d in differences)
    assert settings_differences({0: engine, 1: dict(engine), 2: dict(engine)}) == []


def test_members_whose_settings_differ_refuse_before_connecting(monkeypatch):
    """The trainer's plain environment and a vLLM worker's batch-invariant one: both members raise
    SettingsMismatchError naming the variables, and no process group is created."""
    settings = {0: group_settings("gloo"), 1: {**group_settings("gloo"), "nccl_env": VLLM_BATCH_INVARIANT_NCCL}}
    monkeypatch.setattr(
        broadcast_group, "group_settings", lambda backend: settings[int(threading.current_thread().name[-1])]
    )
    created = []
    monkeypatch.setattr(broadcast_group, "_process_group", lambda *a: created.append(a))
    port = free_port()

    def member(rank: int):
        threading.current_thread().name = f"member-{rank}"
        return StoreGroup(
            host="127.0.0.1",
            port=port,
            rank=rank,
            world_size=2,
            device="cpu",
            secret=SECRET,
            timeout=_seconds(GROUP_TIMEOUT_S),
        )

    results = run_members(member, member)
    for error, seconds in results:
        assert isinstance(error, SettingsMismatchError), error
        assert "NCCL_MAX_NCHANNELS: member 0 <unset>, member 1 1" in str(error) and "VLLM_BATCH_INVARIANT" in str(error)
        assert seconds < 10
    assert created == []


def test_a_wait_that_ends_as_the_group_fails_raises():
    """A failed group's NCCL communicator is aborted, which ends its collectives' kernels: their work then
    reads as completed, their tensors hold no result. A wait that sees its work done once the group failed
    (the watchdog marked it between two polls) raises instead of handing that tensor back. Seen on 2x H200
    (scripts/check_store_group_nccl_gpu.py, engine-killed): a trainer read an all-zero status, "OK", 15 s
    after its engine was killed."""
    port = free_port()

    def member(rank: int):
        group = StoreGroup(
            host="127.0.0.1",
            port=port,
            rank=rank,
            world_size=2,
            device="cpu",
            secret=SECRET,
            timeout=_seconds(GROUP_TIMEOUT_S),
        )
        polls = []

        def done() -> bool:  # the second poll finds the work ended by the group's failure
            polls.append(True)
            if len(polls) == 2:
                group._mark_failed("injected: member 1 has sent no heartbeat")
            return len(polls) >= 2

        try:
            if rank == 0:
                group._wait_until(done, "the status all-reduce")
        finally:
            group.close()

    (error, _), (other, _) = run_members(member, member)
    assert isinstance(error, PeerFailedError) and "injected" in str(error), error
    assert other is None, other


def _seconds(value: float):
    import datetime

    return datetime.timedelta(seconds=value)


# --- who may talk to the group (issue #59) ---------------------------------------------------------


def _non_loopback_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (the route's source address, and the host name's)."""
    found = set()
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))  # a UDP connect sends nothing: it picks the source address
        found.add(probe.getsockname()[0])
    with contextlib.suppress(OSError):
        found.update(socket.gethostbyname_ex(socket.gethostname())[2])
    return sorted(a for a in found if not a.startswith("127.") and a != "0.0.0.0")


def _connects(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
    except OSError:
        return False
    return True


def test_the_store_listens_on_the_given_host_only():
    """Given 127.0.0.1, the group's store takes connections there and not on this machine's other
    addresses (torch's TCPStore listened on every interface, whatever its host)."""
    addresses = _non_loopback_addresses()
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address to try the store's port on")
    port = free_port()
    group = StoreGroup(host="127.0.0.1", port=port, rank=0, world_size=1, device="cpu", secret=SECRET)
    try:
        assert _connects("127.0.0.1", port)
        assert [a for a in addresses if _connects(a, port)] == [], f"the store at 127.0.0.1:{port} is reachable there"
    finally:
        group.close()


def _stranger(port: int) -> torch.distributed.TCPStore:
    """A plain store client at the group's address: what any local user can open."""
    return torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=_seconds(10))


def _peek(store, key: str) -> bytes | None:
    """What a stranger reads at ``key`` (None: nothing there), without waiting for it."""
    return store.get(key) if store.check([key]) else None


FORGED_FAILURE = "forged by a stranger: abort the refit"


def test_a_stranger_on_the_store_reads_no_settings_and_forges_nothing(caplog):
    """A plain store client at the group's address (any local user) reads every entry the members
    coordinate through and writes forged ones: settings for member 1 before it joins, failures of
    member 0, of member 1 and of a member the group does not have, heartbeats of both, in the layout
    the members used before they signed entries (a shared failure counter, plain JSON) and as signed
    entries with a wrong MAC. It reads neither member's settings nor the secret; the group forms with
    the members' own settings, no forged failure aborts anyone (the watchdogs read them for seconds)
    and the refit arrives bit for bit (against the tensors the test sent). Before the fix member 0
    took the forged settings (SettingsMismatchError) and both members raised the forged failure."""
    port, forged = free_port(), threading.Event()
    caplog.set_level("WARNING", logger="mbridge_refit.engines.broadcast.store_entries")
    groups: list[StoreGroup] = []
    read: dict[str, bytes | None] = {}
    keys = [f"mbridge_refit/{kind}/{member}" for kind in ("settings", "alive", "error") for member in (0, 1)]

    def join(rank: int) -> StoreGroup:
        group = StoreGroup(
            host="127.0.0.1", port=port, rank=rank, world_size=2, device="cpu", secret=SECRET, timeout=_seconds(30)
        )
        groups.append(group)
        return group

    def forge(stranger) -> None:
        bad_mac = {"protocol": STORE_PROTOCOL, "body": FORGED_FAILURE, "mac": "00" * 32}
        stranger.add("mbridge_refit/errors", 3)  # the old layout: a shared counter, then plain records
        for index, member in ((1, 1), (2, 0), (3, 7)):
            stranger.set(f"mbridge_refit/error/{index}", json.dumps({"member": member, "message": FORGED_FAILURE}))
        stranger.set("mbridge_refit/error/0", json.dumps({**bad_mac, "member": 0}))
        stranger.set("mbridge_refit/error/7", json.dumps({**bad_mac, "member": 7}))  # a member the group lacks
        for member in (0, 1):
            stranger.set(f"mbridge_refit/alive/{member}", json.dumps({**bad_mac, "member": member, "body": "999"}))

    def sender(rank: int):
        group = join(0)
        assert forged.wait(BOUND_S)
        sender = PackedBroadcastSender(PLAN, CONFIG, group=group, src=0, device="cpu")
        for name, tensor in plan_tensors(PLAN):
            sender.consume(name, tensor)
        sender.finish()

    def receiver(rank: int):
        stranger = _stranger(port)
        deadline = time.monotonic() + BOUND_S
        while not stranger.check(["mbridge_refit/settings/0"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        forged_settings = {**group_settings("nccl" if torch.cuda.is_available() else "gloo"), "backend": "nccl"}
        stranger.set("mbridge_refit/settings/1", json.dumps(forged_settings))  # a forged arrival of member 1
        time.sleep(0.5)  # member 0 polls the settings every 50 ms: it has read the forged ones
        group = join(1)
        read.update({key: _peek(stranger, key) for key in keys})
        forge(stranger)
        time.sleep(3 * broadcast_group.PEER_CHECK_S)  # both watchdogs have read the forged entries
        forged.set()
        receiving = PackedBroadcastReceiver(PLAN, CONFIG, group=group, src=0, device="cpu")
        return [(name, tensor.clone()) for name, tensor in receiving.receive()]

    (sent, _), (received, _) = run_members(sender, receiver)
    for group in groups:
        group.close()
    assert sent is None and not isinstance(received, BaseException), (sent, received)
    tensors = plan_tensors(PLAN)
    assert [name for name, _ in received] == [name for name, _ in tensors]
    assert all(
        torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        for (_, a), (_, b) in zip(received, tensors)
    )
    values = [value for value in read.values() if value is not None]
    assert read["mbridge_refit/settings/0"] is not None and read["mbridge_refit/settings/1"] is not None
    assert not any(b"gloo" in value or b"backend" in value for value in values), read  # the settings: a keyed digest
    assert not any(secret in value for value in values for secret in (SECRET, SECRET.hex().encode())), read
    assert "ignoring the store entry mbridge_refit/settings/1" in caplog.text
    assert "ignoring the store entry mbridge_refit/error/0" in caplog.text


class OtherProtocolMember(StoreGroup):
    """A member whose store entries are of another protocol (another mbridge_refit), holding the secret."""

    store_protocol = STORE_PROTOCOL + 1


def test_a_member_of_another_store_protocol_is_refused_by_name():
    port = free_port()

    def member(rank: int):
        joining = OtherProtocolMember if rank == 1 else StoreGroup
        joining(host="127.0.0.1", port=port, rank=rank, world_size=2, device="cpu", secret=SECRET, timeout=_seconds(30))

    results = run_members(member, member)
    for rank, (error, seconds) in enumerate(results):
        assert isinstance(error, (StoreProtocolError, PeerFailedError)), error
        mine, theirs = (STORE_PROTOCOL, STORE_PROTOCOL + 1) if rank == 0 else (STORE_PROTOCOL + 1, STORE_PROTOCOL)
        assert f"broadcast group store wire version mismatch: this side speaks version {mine}" in str(error), error
        assert f"version {theirs}" in str(error) and "same mbridge_refit version" in str(error), error
        assert seconds < 10


def test_a_member_with_another_secret_does_not_join():
    """Entries signed with another secret are a stranger's: the member is not counted, and joining fails
    at the timeout naming the members missing and the entries that failed their check."""
    port = free_port()

    def member(rank: int):
        secret = SECRET if rank == 0 else new_secret()
        StoreGroup(
            host="127.0.0.1", port=port, rank=rank, world_size=2, device="cpu", secret=secret, timeout=_seconds(3)
        )

    (first, seconds), (second, _) = run_members(member, member)
    assert isinstance(first, GroupSetupError) and "members [1] did not join" in str(first), first
    assert "failed their check" in str(first) and "secret" in str(first), first
    assert isinstance(second, GroupSetupError) and "members [0] did not join" in str(second), second
    assert seconds < 10


class OtherVersionReceiver(PackedBroadcastReceiver):
    """A receiver of another packed-broadcast wire version (another mbridge_refit on the engine)."""

    wire_version = WIRE_VERSION + 1


def test_a_receiver_of_another_wire_version_is_refused_by_name():
    """Both ends raise ``WireVersionError`` naming the format and both versions, after the same collectives
    as a plan mismatch (a receiver of the version before this check runs those too), and the group stays
    usable."""
    (sent, received), source, receiver = _recorded_pair(PLAN, receiving=OtherVersionReceiver)
    for error, mine, theirs, peer in (
        (sent[0], WIRE_VERSION, WIRE_VERSION + 1, "a receiver"),
        (received[0], WIRE_VERSION + 1, WIRE_VERSION, "the sender"),
    ):
        assert isinstance(error, WireVersionError), error
        assert f"packed broadcast wire version mismatch: this side speaks version {mine}, {peer}" in str(error)
        assert f"version {theirs}. Run the same mbridge_refit version" in str(error), error
    assert source == receiver and ("post_error",) not in source


@pytest.mark.parametrize("version", [None, WIRE_VERSION - 1])
def test_an_engine_refuses_a_trainer_of_another_wire_version_by_name(version):
    """The join arguments of a trainer of another version (None: one from before the version was sent):
    refused before the worker connects (nothing listens at the port)."""
    from mbridge_refit.engines.broadcast.engine import BroadcastTarget

    engine = Engine()
    target = BroadcastTarget(engine.load_weights, engine, "cpu")
    arguments = dict(
        host="127.0.0.1", port=free_port(), rank=1, world_size=2, plan_json=PLAN.to_json(), config={}, timeout_s=5.0
    )
    with pytest.raises(WireVersionError, match="packed broadcast wire version mismatch") as caught:
        target.join(**arguments, secret=SECRET.hex(), wire_version=version)
    shown = "none (an mbridge_refit from before it was versioned)" if version is None else version
    assert f"this side speaks version {WIRE_VERSION}, the trainer version {shown}" in str(caught.value)
    assert target.group is None


# --- failures reach every member -------------------------------------------------------------------


class Engine(torch.nn.Module):
    """An engine model whose loader keeps copies of what it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.got: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.got[name] = tensor.clone()


class InProcessLLM:
    """``LLM.collective_rpc`` onto a ``RefitWorkerExtension`` in this process; each worker call's
    exception is kept. ``fail`` names a method that raises before it runs (the worker's RPC failing
    outside the refit's code)."""

    def __init__(self, engine: Engine, fail: str | None = None) -> None:
        from mbridge_refit.engines.vllm.worker import RefitWorkerExtension

        self.worker = RefitWorkerExtension()
        self.worker.model_runner = SimpleNamespace(get_model=lambda: engine)
        self.worker.device = "cpu"
        self.fail, self.errors = fail, []
        self.prefix_cache_resets = 0
        self.refuse_reset = False

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return not self.refuse_reset

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        try:
            if method == self.fail:
                raise RuntimeError(f"injected: the worker's {method} RPC died")
            return [getattr(self.worker, method)(*args)]
        except BaseException as err:
            self.errors.append((method, err, time.monotonic()))
            raise


class Bridge:
    """What ``VLLMBroadcastRefit`` asks of a bridge: the plan and the export stream (which raises
    after ``fail_after`` tensors when set)."""

    hf_pretrained = SimpleNamespace(config=SimpleNamespace(tie_word_embeddings=False))

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after

    def export_plan(self, chunks, fp8=None):
        return PLAN

    def export_hf_weights(self, chunks, **kwargs):
        for index, item in enumerate(plan_tensors(PLAN)):
            if index == self.fail_after:
                raise ValueError("injected: the trainer's export failed")
            yield item


def _session(llm, bridge, chunks, **options):
    from mbridge_refit.engines.vllm import VLLMBroadcastRefit

    refit = VLLMBroadcastRefit(
        llm,
        host="127.0.0.1",
        port=free_port(),
        backend="gloo",
        device="cpu",
        timeout_s=GROUP_TIMEOUT_S,
        **{"config": CONFIG, **options},
    )
    refit.open(bridge, chunks)
    return refit


def _refit_raises(refit, bridge, chunks) -> tuple[BaseException, float]:
    started = time.monotonic()
    with pytest.raises(Exception) as caught:
        refit.refit(bridge, chunks)
    return caught.value, time.monotonic() - started


def test_receiver_failing_in_the_handshake_reaches_the_trainer():
    """The issue's case: the engine worker's first collective (the header broadcast) raises; the
    trainer raises that error within the bound instead of waiting for the group's timeout."""
    llm, chunks, bridge = InProcessLLM(Engine()), [torch.nn.Linear(1, 1)], Bridge()
    refit = _session(llm, bridge, chunks)
    group = llm.worker._mbridge_broadcast_target.group

    def broken(tensor, src, *, async_op=False):
        raise RuntimeError("injected: ncclInternalError: Message truncated: received 12288 bytes instead of 512")

    group.broadcast = broken
    error, seconds = _refit_raises(refit, bridge, chunks)
    assert seconds < BOUND_S, f"the trainer raised after {seconds:.0f} s"
    assert "Message truncated" in str(error)
    assert [m for m, _, _ in llm.errors] == ["mbridge_refit_receive"]
    with pytest.raises(PeerFailedError, match="failed group"):  # the group stays failed: open() a new one
        refit.group.broadcast(torch.zeros(1), 0)
    refit.close()


@pytest.mark.parametrize("fail_after", [1, 2], ids=["before_the_verdict", "after_it"])
def test_the_trainers_export_failing_mid_stream_reaches_the_engine(fail_after):
    """The export raises before the entry where the verdict is taken (``agree_at``, 1 here: the first
    entry already packed, nothing sent) or after it: the engine raises the trainer's error either way; a
    reset was asked for only once the verdict was in."""
    llm, chunks, bridge = InProcessLLM(Engine()), [torch.nn.Linear(1, 1)], Bridge(fail_after=fail_after)
    refit = _session(llm, bridge, chunks)
    assert SendBuffers(PLAN, CONFIG).agree_at == 1
    error, seconds = _refit_raises(refit, bridge, chunks)
    assert isinstance(error, ValueError) and "injected: the trainer's export failed" in str(error)
    assert seconds < BOUND_S
    ((method, engine_error, _),) = llm.errors
    assert method == "mbridge_refit_receive" and isinstance(engine_error, PeerFailedError), engine_error
    assert "member 0 failed" in str(engine_error) and "injected: the trainer's export failed" in str(engine_error)
    time.sleep(0.5)  # a reset asked for would have reached the engine by now
    assert llm.prefix_cache_resets == (1 if fail_after > 1 else 0)
    refit.close()


def test_the_engines_rpc_failing_outside_the_protocol_reaches_the_trainer():
    """The worker's RPC fails before it reaches the receiver (nothing posted from the engine): the
    trainer, waiting in the handshake, treats the RPC's error as the engine's failure."""
    llm, chunks, bridge = InProcessLLM(Engine(), fail="mbridge_refit_receive"), [torch.nn.Linear(1, 1)], Bridge()
    refit = _session(llm, bridge, chunks)
    error, seconds = _refit_raises(refit, bridge, chunks)
    assert seconds < BOUND_S and "injected: the worker's mbridge_refit_receive RPC died" in str(error)
    refit.close()


def test_a_plan_mismatch_raises_on_both_and_the_group_stays_usable():
    llm, chunks, bridge = InProcessLLM(Engine()), [torch.nn.Linear(1, 1)], Bridge()
    refit = _session(llm, bridge, chunks)
    target = llm.worker._mbridge_broadcast_target
    right = target.plan_json
    plan = json.loads(right)
    plan["entries"][1] = {**plan["entries"][1], "hf_name": "b.renamed"}
    target.plan_json = json.dumps(plan)
    error, seconds = _refit_raises(refit, bridge, chunks)
    assert isinstance(error, PlanMismatchError) and seconds < BOUND_S
    assert isinstance(llm.errors[0][1], PlanMismatchError)
    target.plan_json = right
    engine = llm.worker.model_runner.get_model()
    resets = llm.prefix_cache_resets
    assert refit.refit(bridge, chunks).tensors == 5  # a failure the protocol reports leaves the group in step
    assert all(torch.equal(engine.got[name], tensor) for name, tensor in plan_tensors(PLAN))
    assert (resets, llm.prefix_cache_resets) == (0, 1)  # the mismatched step asked for no reset
    refit.close()


class OrderedLLM(InProcessLLM):
    """``InProcessLLM`` noting when the workers' receive starts and ends and when the reset comes; the
    receive, once its protocol is done, waits (up to ``HOLD_S``) for the reset before it returns."""

    HOLD_S = 3.0

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.events: list[str] = []
        self._reset = threading.Event()

    def reset_prefix_cache(self) -> bool:
        self.events.append("reset")
        self._reset.set()
        return super().reset_prefix_cache()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method != "mbridge_refit_receive":
            return super().collective_rpc(method, timeout, args, kwargs)
        self.events.append("receive")
        result = super().collective_rpc(method, timeout, args, kwargs)
        self._reset.wait(self.HOLD_S)
        self.events.append("received")
        self._reset.clear()
        return result


@pytest.mark.parametrize(
    ("overlap", "config"),
    [(True, CONFIG), (False, CONFIG), (True, PackedBroadcastConfig(bucket_bytes=4096, num_buffers=2))],
    ids=["overlapped", "after", "overlapped_one_bucket"],
)
def test_the_reset_is_asked_for_while_the_buckets_go_out(overlap, config):
    """With ``overlap_follow_up`` the prefix-cache reset starts once the handshake's verdict shows the
    workers in their receive (in ``finish`` where the whole stream is one bucket), so it is in the engine's
    queue before the receive ends; without, it follows the receive. Either way the step returns only after
    both, with the weights written."""
    llm, chunks, bridge = OrderedLLM(Engine()), [torch.nn.Linear(1, 1)], Bridge()
    refit = _session(llm, bridge, chunks, overlap_follow_up=overlap, config=config)
    llm.events.clear()
    step = refit.refit(bridge, chunks)
    assert step.tensors == 5 and llm.prefix_cache_resets == 1
    expected = ["receive", "reset", "received"] if overlap else ["receive", "received", "reset"]
    assert llm.events == expected
    engine = llm.worker.model_runner.get_model()
    assert all(torch.equal(engine.got[name], tensor) for name, tensor in plan_tensors(PLAN))
    refit.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "after"])
def test_a_refused_reset_fails_the_step(overlap):
    from mbridge_refit.errors import EngineError

    llm, chunks, bridge = InProcessLLM(Engine()), [torch.nn.Linear(1, 1)], Bridge()
    refit = _session(llm, bridge, chunks, overlap_follow_up=overlap)
    llm.refuse_reset = True
    with pytest.raises(EngineError, match="refused to reset its prefix cache"):
        refit.refit(bridge, chunks)
    llm.refuse_reset = False
    assert refit.refit(bridge, chunks).tensors == 5  # the protocol itself ended well: the group goes on
    refit.close()


def test_a_failed_step_notes_its_reset_without_waiting_for_it():
    """The trainer's export fails mid-stream after the reset was asked for. A reset that failed already is
    noted on the trainer's error; one still pending (an engine that queues it behind the failed receive,
    or never answers) is noted as pending, and the step raises without waiting for it."""
    llm, chunks, bridge = InProcessLLM(Engine()), [torch.nn.Linear(1, 1)], Bridge(fail_after=2)
    refit = _session(llm, bridge, chunks)
    llm.refuse_reset = True
    error, seconds = _refit_raises(refit, bridge, chunks)
    assert isinstance(error, ValueError) and seconds < BOUND_S
    assert any("the engine's follow-up also failed" in note and "refused" in note for note in error.__notes__)
    refit.close()

    release = threading.Event()
    llm, bridge = InProcessLLM(Engine()), Bridge(fail_after=2)
    llm.reset_prefix_cache = lambda: release.wait(60) or True  # the engine holds the reset back
    refit = _session(llm, bridge, chunks)
    error, seconds = _refit_raises(refit, bridge, chunks)
    assert isinstance(error, ValueError) and seconds < 10, seconds
    assert "the engine's follow-up was still pending when the step failed" in error.__notes__
    pending = [t for t in threading.enumerate() if t.name == "refit-follow-up"]
    assert pending, "the reset was still running: the step did not wait for it"
    release.set()
    pending[0].join(10)
    assert not pending[0].is_alive()
    refit.close()


def test_a_reset_that_does_not_answer_fails_the_step_by_name():
    """The receive went well and the reset never answers: the step fails after ``timeout_s`` naming the
    follow-up, not the workers."""
    release = threading.Event()
    llm, chunks, bridge = InProcessLLM(Engine()), [torch.nn.Linear(1, 1)], Bridge()
    refit = _session(llm, bridge, chunks)
    refit.timeout_s = 2.0
    llm.reset_prefix_cache = lambda: release.wait(60) or True
    with pytest.raises(TimeoutError, match="the engine's follow-up did not answer within 2 s"):
        refit.refit(bridge, chunks)
    release.set()
    refit.timeout_s = GROUP_TIMEOUT_S
    refit.close()


TRAINER = r"""
import json, os, signal, sys, time
sys.path.insert(0, {repo!r})
from mbridge_refit.plan.entries import ExportPlan
from mbridge_refit.engines.broadcast.group import StoreGroup
from mbridge_refit.engines.broadcast.packed import PackedBroadcastConfig, PackedBroadcastSender, SendBuffers
import torch
plan = ExportPlan.from_json({plan!r})
group = StoreGroup(host="127.0.0.1", port={port}, rank=0, world_size=2, device="cpu", secret=bytes.fromhex({secret!r}))
config = PackedBroadcastConfig(bucket_bytes=64, num_buffers=2)
sender = PackedBroadcastSender(plan, config, group=group, src=0, device="cpu")
for entry in plan.entries[: SendBuffers(plan, config).agree_at + 1]:  # the verdict taken, bucket 0 sent
    sender.consume(entry.hf_name, torch.zeros(entry.shape, dtype=entry.torch_dtype))
print("handshake done", flush=True)
time.sleep(1.0)
os.kill(os.getpid(), signal.{signal})
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"], ids=["dies", "stops"])
def test_the_trainers_process_dying_or_stopping_reaches_the_engine(how, tmp_path):
    """The trainer's process is killed, or stopped (its sockets stay open: a process that no longer
    answers), after the handshake and the first bucket, while the receiver waits for the next: the receiver
    raises within the bound (a killed peer closes gloo's sockets; a stopped one is seen by its
    silent store and heartbeat)."""
    port = free_port()
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(repo=str(REPO), plan=PLAN.to_json(), port=port, signal=how, secret=SECRET.hex()))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        group = StoreGroup(
            host="127.0.0.1",
            port=port,
            rank=1,
            world_size=2,
            device="cpu",
            secret=SECRET,
            timeout=_seconds(GROUP_TIMEOUT_S),
        )
        receiver = PackedBroadcastReceiver(
            PLAN, PackedBroadcastConfig(bucket_bytes=64, num_buffers=2), group=group, src=0, device="cpu"
        )
        started = time.monotonic()
        with pytest.raises(Exception) as caught:
            for _ in receiver.receive():
                pass
        seconds = time.monotonic() - started
        assert seconds < BOUND_S, f"the receiver raised after {seconds:.0f} s: {caught.value}"
        if how == "SIGSTOP":
            assert isinstance(caught.value, PeerFailedError) and "has not answered" in str(caught.value), caught.value
        group.close()
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)


NEVER_CLOSED = r"""
import sys, time
sys.path.insert(0, {repo!r})
from mbridge_refit.engines.broadcast import group as broadcast_group
broadcast_group.PEER_CHECK_S = 0.0  # the watchdog is in a store call nearly all the time
group = broadcast_group.StoreGroup(
    host="127.0.0.1", port={port}, rank=0, world_size=1, device="cpu", secret=broadcast_group.new_secret()
)
time.sleep(0.05)
print("exiting with the group open", flush=True)
"""


def test_a_program_that_ends_with_a_group_open_exits_cleanly(tmp_path):
    """A program that ends without closing its group (a session left open by an error) exits with
    its own status: the watchdog is stopped before the interpreter finalizes. Without that, a
    watchdog inside a store call when finalization begins aborts the process ("terminate called
    without an active exception", exit code 134; seen once in CI at the default check interval,
    every time here where the watchdog polls without pause)."""
    script = tmp_path / "never_closed.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        script.write_text(NEVER_CLOSED.format(repo=str(REPO), port=free_port()))
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "exiting with the group open" in done.stdout, (done.returncode, done.stderr)
