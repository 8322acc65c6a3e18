"""Figure 1, the broker hop: batches of 1, 16, 64, 256 KiB, 1 and 4 MiB between separate processes, three ways.

* ``direct``: a raw pyzmq PUSH -> PULL (no broker).
* ``zmq.proxy``: the same through ``zmq.proxy(PULL, PUSH)`` in a third process (the C broker: the limit of a hop).
* ``sparkbus``: the sparkbus broker started through its CLI, fed through ``feeder.task.stream_partition`` (one
  partition of an epoch opened with ``EPOCH_OPEN`` and closed with ``EPOCH_CLOSE``) and consumed by
  ``worker.BatchStream(comm=None)`` iterating ``epoch()`` (defaults: ``prefetch=4``, checksum verified).

Every measurement sends one column of float32 of the given size for at least ``hop_seconds`` (and at least
``hop_min_batches`` batches) and is timed from the sender's first send to the receiver's last receive. Raw
modes send the very message sparkbus sends (header + column frame), encoded once.

Diagnostic rows (not targets) repeat the sparkbus hop with one default changed: ``prefetch=64`` at 1 KiB (how much
of that figure is the credit round trip), ``verify=False`` at 1 MiB (what the ranks' checksum costs) and, where the
feeder packs small batches into one message, ``pack_bytes=0`` at 1 and 64 KiB (what packing gains).

CURVE (a cost, not a target): at 64 KiB and 1 MiB the sparkbus hop runs again through a second broker started
with ``--auth DIR`` (the same flags otherwise), with keys made in the run's temporary directory by
``broker.auth.create_keypair`` (the broker's pair in ``DIR``, the feeder's and the rank's public keys in
``DIR/feeders`` and ``DIR/ranks``), the feeder, the control client and the ``BatchStream`` passing ``key=`` and
``broker_key=``. Each repetition measures it right after the plain sparkbus hop of the same size, whose figure is
the "plain" one it is compared with.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import agents
from broker.client import ControlClient
from broker.protocol import Kind
from common import open_epoch, Agent, BenchError, KiB, MiB, Children, Sizes, median

SIZES = (1 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
MODES = ("direct", "zmq.proxy", "sparkbus")
HOP_MAX_BUFFER = 256 * MiB
CURVE_SIZES = (64 * KiB, 1 * MiB)
CURVE_MODE = "sparkbus, CURVE"          # the HopResult.mode of the CURVE rows (plain: "sparkbus")
_streams = itertools.count()


def size_label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def hwm_for(size: int) -> int:
    """Raw-socket queue depth: about 64 MiB of messages, between 16 and 1000 (ZeroMQ's default)."""
    return max(16, min(1000, (64 * MiB) // size))


@dataclass
class HopResult:
    mode: str
    size: int
    runs: list[dict] = field(default_factory=list)       # per repetition: batches, seconds

    @property
    def batches_per_s(self) -> float:
        return median([r["batches"] / r["seconds"] for r in self.runs])

    @property
    def mb_per_s(self) -> float:
        return median([r["batches"] * self.size / r["seconds"] / 1e6 for r in self.runs])

    def cpu_per_gb(self, role: str) -> float | None:
        """Median CPU seconds per GB of payload of ``role`` (sender, middle, receiver), if measured."""
        per_gb = [r["cpu"][role] / (r["batches"] * self.size / 1e9) for r in self.runs if r.get("cpu")]
        return median(per_gb) if per_gb else None

    @property
    def spread(self) -> tuple[float, float]:
        rates = [r["batches"] * self.size / r["seconds"] / 1e6 for r in self.runs]
        return min(rates), max(rates)


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far; 0 without one."""
    import psutil

    if pid is None:
        return 0.0
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _measure(sender: Agent, receiver: Agent, send_job: dict, receive_job: dict, timeout: float,
             before=None, after=None, middle: int | None = None) -> dict:
    """One hop; also the CPU seconds the sender, the process in the middle (pid ``middle``) and the receiver
    spent from before the first send to after the last receive."""
    receiver.send(receive_job)
    ready = receiver.recv(timeout, "its ready message")
    if before:
        before()
    pids = {"sender": sender.pid, "middle": middle, "receiver": receiver.pid}
    cpu = {role: _cpu_seconds(pid) for role, pid in pids.items()}
    sender.send({**send_job, "address": send_job.get("address") or ready["endpoint"]})
    sent = sender.recv(timeout + 60 * (send_job["size"] >= MiB), "the end of its send")
    if after:
        after()
    got = receiver.recv(timeout, "the end of its receive")
    cpu = {role: _cpu_seconds(pid) - cpu[role] for role, pid in pids.items()}
    if got["received"] != sent["sent"]:
        raise BenchError(f"{send_job['mode']} hop at {size_label(send_job['size'])}: sent {sent['sent']}, "
                           f"received {got['received']}")
    return {"batches": got["received"], "seconds": got["t_last"] - sent["t_first"],
            "wait_seconds": got.get("wait_seconds"), "epoch_seconds": got.get("seconds"), "cpu": cpu}


def feeder_pack_bytes() -> int | None:
    """The feeder's default pack size if this version packs consecutive small batches into one message, else None."""
    import feeder.task

    return getattr(feeder.task, "DEFAULT_PACK_BYTES", None)


def diagnostics() -> list[tuple[str, int, dict]]:
    """Diagnostics (not targets): the sparkbus hop again with one default changed, to tell causes apart.

    ``(label, batch size, changed settings)``; the settings are ``prefetch``, ``verify`` (the rank's) and
    ``pack_bytes`` (the feeder's, 0 = one message per batch, where the feeder packs small batches).
    """
    rows = [("sparkbus, prefetch 64", 1 * KiB, {"prefetch": 64}),
            ("sparkbus, verify=False", 1 * MiB, {"verify": False})]
    if feeder_pack_bytes():
        rows += [("sparkbus, unpacked", size, {"pack_bytes": 0}) for size in (1 * KiB, 64 * KiB)]
    return rows


@dataclass
class CurveKeys:
    """Key files for the CURVE hop: the broker's ``--auth`` directory and what the clients pass."""

    auth_dir: Path          # --auth DIR: broker.key_secret, feeders/*.key, ranks/*.key
    broker_key: str         # the broker's public key (.key): every client's broker_key=
    feeder: str             # the feeder's pair (.key_secret): stream_partition's and the control client's key=
    rank: str               # the rank's pair (.key_secret): BatchStream's key=


def make_curve_keys(root: Path) -> CurveKeys:
    """New key pairs under ``root`` (the run's temporary directory): the broker's, a feeder's and a rank's.

    The clients' pairs stay in ``root/clients``; only their public ``.key`` files are copied into the broker's
    ``feeders/`` and ``ranks/`` folders.
    """
    from broker.auth import create_keypair

    auth, clients = root / "auth", root / "clients"
    for folder in (auth / "feeders", auth / "ranks", clients):
        folder.mkdir(parents=True)
    broker_public, _ = create_keypair(auth / "broker")
    secrets = {}
    for role, folder in (("feeder", "feeders"), ("rank", "ranks")):
        public, secrets[role] = create_keypair(clients / f"bench-{role}")
        shutil.copy(public, auth / folder / public.name)
    return CurveKeys(auth, str(broker_public), str(secrets["feeder"]), str(secrets["rank"]))


def curve_pairs(hop: list[HopResult]) -> list[tuple[HopResult, HopResult]]:
    """``(plain, CURVE)`` sparkbus results per size measured with CURVE, in size order."""
    by = {(h.mode, h.size): h for h in hop}
    return [(by["sparkbus", size], by[CURVE_MODE, size]) for size in SIZES
            if (CURVE_MODE, size) in by and ("sparkbus", size) in by and by[CURVE_MODE, size].runs]


def run(children: Children, sizes: Sizes, log=print) -> list[HopResult]:
    """All hop measurements; repetitions are interleaved so that noise spreads over every mode."""
    results = {(m, s): HopResult(m, s) for m in MODES for s in SIZES}
    extra = {(label, size): HopResult(label, size) for label, size, _ in diagnostics()}
    curve = {size: HopResult(CURVE_MODE, size) for size in CURVE_SIZES}
    sender = children.agent("hop-sender", agents.sender)
    receiver = children.agent("hop-receiver", agents.receiver)
    broker = children.broker(HOP_MAX_BUFFER)
    keys = make_curve_keys(children.logs / "curve-keys")
    curve_broker = children.broker(HOP_MAX_BUFFER, 20.0, "--auth", str(keys.auth_dir))
    timeout = max(30.0, sizes.hop_seconds * 20)
    try:
        for size in SIZES:
            base = {"size": size, "seconds": sizes.hop_seconds, "min_batches": sizes.hop_min_batches,
                    "timeout": timeout}
            proxy = children.agent(f"zmq-proxy-{size_label(size)}", agents.proxy, hwm_for(size))
            ends = proxy.recv(timeout, "its endpoints")
            try:
                for rep in range(sizes.reps):
                    run_one = {
                        "direct": lambda: _measure(sender, receiver, {**base, "mode": "zmq", "hwm": hwm_for(size)},
                                                   {**base, "mode": "zmq", "hwm": hwm_for(size)}, timeout),
                        "zmq.proxy": lambda: _measure(
                            sender, receiver, {**base, "mode": "zmq", "hwm": hwm_for(size), "address": ends["front"]},
                            {**base, "mode": "zmq", "hwm": hwm_for(size), "address": ends["back"]}, timeout,
                            middle=proxy.pid),
                        "sparkbus": lambda: _sparkbus(sender, receiver, broker, base, timeout),
                    }
                    for mode in MODES:
                        results[mode, size].runs.append(run_one[mode]())
                    if size in curve:          # right after the plain sparkbus hop it is compared with
                        curve[size].runs.append(_sparkbus(sender, receiver, curve_broker, base, timeout, keys=keys))
                    for label, diag_size, changed in diagnostics():
                        if diag_size == size:
                            extra[label, size].runs.append(_sparkbus(sender, receiver, broker, base, timeout,
                                                                     **changed))
            finally:
                children.discard(proxy)
            line = "  ".join(f"{m} {results[m, size].mb_per_s:8.1f} MB/s {results[m, size].batches_per_s:9.0f} b/s"
                             for m in MODES)
            log(f"  hop {size_label(size):>6}: {line}")
            if size in curve:
                plain, secured = results["sparkbus", size], curve[size]
                log(f"  hop {size_label(size):>6}: sparkbus with CURVE (--auth) {secured.mb_per_s:8.1f} MB/s "
                    f"{secured.batches_per_s:9.0f} b/s: {secured.mb_per_s / plain.mb_per_s:.2f} x plain")
        for result in extra.values():
            log(f"  hop {size_label(result.size):>6}: {result.mode}: {result.mb_per_s:8.1f} MB/s "
                f"{result.batches_per_s:9.0f} b/s (diagnostic)")
    finally:
        for child in (curve_broker, broker, receiver, sender):
            children.discard(child)
    return [results[m, s] for s in SIZES for m in MODES] + list(extra.values()) + list(curve.values())


def _sparkbus(sender, receiver, broker, base: dict, timeout: float, prefetch: int = 4, verify: bool = True,
              pack_bytes: int | None = None, keys: CurveKeys | None = None) -> dict:
    """One sparkbus hop; with ``keys``, through a broker run with ``--auth`` (every client passes its keys)."""
    stream = f"hop-{next(_streams)}"
    feeder_keys = {} if keys is None else {"key": keys.feeder, "broker_key": keys.broker_key}
    rank_keys = {} if keys is None else {"key": keys.rank, "broker_key": keys.broker_key}
    client = ControlClient(broker.control, timeout, **feeder_keys)
    try:
        open_epoch(client, stream, 0, 1)
        return _measure(
            sender, receiver,
            {**base, "mode": "sparkbus", "feed": broker.feed, "control": broker.control, "stream": stream,
             "address": broker.feed, **({} if pack_bytes is None else {"pack_bytes": pack_bytes}), **feeder_keys},
            {**base, "mode": "sparkbus", "ranks": broker.ranks, "stream": stream, "prefetch": prefetch,
             "verify": verify, **rank_keys},
            timeout, after=lambda: client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=0, partitions=1),
            middle=broker.pid)
    finally:
        client.close()


__all__ = ["run", "HopResult", "SIZES", "MODES", "CURVE_SIZES", "CURVE_MODE", "curve_pairs", "size_label"]
