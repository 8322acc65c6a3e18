"""Figure 1, the broker hop: batches of 1 KiB to 4 MiB between processes, ``direct`` (raw pyzmq PUSH -> PULL),
through ``zmq.proxy`` (the C broker: the limit of a hop) and through ``sparkbus`` (its CLI broker, fed by
``feeder.task.stream_partition``, consumed by ``BatchStream(comm=None)``); diagnostics with one default changed;
the same sparkbus hop with CURVE (``--auth``). benchmarks/README.md, section 1, says how each is measured.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbus.bench.figures import Figure, figure
from sparkbus.bench.hop import recording_cost
from sparkbus.broker.client import ControlClient
from sparkbus.wire.protocol import Kind

from . import agents
from .common import Agent, BenchError, Children, KiB, MiB, Sizes, median, open_epoch
from .sections import Context, Run, Section, Table

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
    from sparkbus.feeder import task

    return getattr(task, "DEFAULT_PACK_BYTES", None)


def diagnostics() -> list[tuple[str, int, dict[str, Any]]]:
    """Diagnostics (not targets): the sparkbus hop again with one default changed, to tell causes apart.

    ``(label, batch size, changed settings)``; the settings are ``prefetch``, ``verify`` (the rank's) and
    ``pack_bytes`` (the feeder's, 0 = one message per batch, where the feeder packs small batches).
    """
    rows: list[tuple[str, int, dict[str, Any]]] = [("sparkbus, prefetch 64", 1 * KiB, {"prefetch": 64}),
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
    from sparkbus.broker.auth import create_keypair

    auth, clients = root / "auth", root / "clients"
    for folder in (auth / "feeders", auth / "ranks", clients):
        folder.mkdir(parents=True)
    broker_public, _ = create_keypair(auth / "broker")
    secrets: dict[str, Path] = {}
    for role, keys_folder in (("feeder", "feeders"), ("rank", "ranks")):
        public, secrets[role] = create_keypair(clients / f"bench-{role}")
        shutil.copy(public, auth / keys_folder / public.name)
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
                for _ in range(sizes.reps):
                    for mode in MODES:
                        results[mode, size].runs.append(
                            _one_hop(mode, size, sender, receiver, broker, proxy, ends, base, timeout))
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


def _one_hop(mode: str, size: int, sender: Agent, receiver: Agent, broker, proxy: Agent, ends: dict, base: dict,
             timeout: float) -> dict:
    """One repetition of one of the three ways (the raw ones with a queue of about 64 MiB)."""
    if mode == "direct":
        return _measure(sender, receiver, {**base, "mode": "zmq", "hwm": hwm_for(size)},
                        {**base, "mode": "zmq", "hwm": hwm_for(size)}, timeout)
    if mode == "zmq.proxy":
        return _measure(sender, receiver, {**base, "mode": "zmq", "hwm": hwm_for(size), "address": ends["front"]},
                        {**base, "mode": "zmq", "hwm": hwm_for(size), "address": ends["back"]}, timeout,
                        middle=proxy.pid)
    return _sparkbus(sender, receiver, broker, base, timeout)


def _sparkbus(sender, receiver, broker, base: dict, timeout: float, prefetch: int = 4, verify: bool = True,
              pack_bytes: int | None = None, keys: CurveKeys | None = None) -> dict:
    """One sparkbus hop; with ``keys``, through a broker run with ``--auth`` (every client passes its keys)."""
    stream = f"hop-{next(_streams)}"
    feeder_keys: dict[str, Any] = {} if keys is None else {"key": keys.feeder, "broker_key": keys.broker_key}
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


# ---- the section ------------------------------------------------------------------------------------------

class HopSection(Section[list[HopResult]]):
    """Figure 1: the broker hop, its diagnostics, the CPU of each process, and what CURVE costs."""

    name, title, figure = "hop", "1. broker hop", "1"

    def measure(self, ctx: Context) -> list[HopResult]:
        return run(ctx.children, ctx.sizes, ctx.log)

    def figures(self, run: Run, result: list[HopResult]) -> list[Figure]:
        """MB/s per way and size (direct, then zmq.proxy against direct, sparkbus against zmq.proxy), batches/s at
        1 KiB, and each diagnostic or CURVE row against the plain sparkbus hop of its size."""
        hop = {(h.mode, h.size): h for h in result}
        out: list[Figure] = []

        def add(h: HopResult, name: str, anchor: Figure | None, batches: bool = False) -> Figure:
            reps = [r["batches"] / r["seconds"] * (1 if batches else h.size / 1e6) for r in h.runs]
            out.append(figure("hop", name, reps, "batches/s" if batches else "MB/s", anchor))
            return out[-1]

        for size in SIZES:
            if all((m, size) in hop for m in MODES):
                for batches in (False, True) if size == KiB else (False,):
                    unit = " batches/s" if batches else ""
                    direct = add(hop["direct", size], f"direct {size_label(size)}{unit}", None, batches)
                    proxy = add(hop["zmq.proxy", size], f"zmq.proxy {size_label(size)}{unit}", direct, batches)
                    add(hop["sparkbus", size], f"sparkbus {size_label(size)}{unit}", proxy, batches)
        plain = {f.name: f for f in out}
        if "sparkbus 64 KiB" in plain:          # what recording why training waits costs, against this hop
            out += recording_cost(plain["sparkbus 64 KiB"])
        for h in result:
            anchor = plain.get(f"sparkbus {size_label(h.size)}")
            if h.mode not in MODES and h.runs and anchor is not None:
                add(h, f"{h.mode} {size_label(h.size)}", anchor)
        return out

    def tables(self, run: Run, result: list[HopResult]) -> list[Table]:
        from sparkbus.broker.daemon import IO_THREADS

        hop = {(h.mode, h.size): h for h in result}
        pack = feeder_pack_bytes()
        rates = Table("MB/s of payload and batches/s, sender's first send to receiver's last receive",
                      ["batch", *[f"{m} {unit}" for m in MODES for unit in ("MB/s", "b/s")],
                       "sparkbus / zmq.proxy", "sparkbus / direct"],
                      [[size_label(size), *[v for m in MODES for v in (hop[m, size].mb_per_s,
                                                                        hop[m, size].batches_per_s)],
                        hop["sparkbus", size].mb_per_s / hop["zmq.proxy", size].mb_per_s,
                        hop["sparkbus", size].mb_per_s / hop["direct", size].mb_per_s] for size in SIZES],
                      [f"the feeder packs batches under {size_label(pack // 4)} into messages of up to "
                       f"{size_label(pack)}; b/s counts the batches the BatchStream loop received" if pack else
                       "sparkbus sends one message per batch"],
                      plot=tuple(f"{m} MB/s" for m in MODES), log=True)
        extra = [h for h in result if h.mode not in MODES and h.mode != CURVE_MODE]
        diagnostics = Table("Diagnostics: the sparkbus hop with one default changed", ["way", "batch", "MB/s", "b/s",
                            "vs the default"], [[h.mode, size_label(h.size), h.mb_per_s, h.batches_per_s,
                                                 h.mb_per_s / hop["sparkbus", h.size].mb_per_s] for h in extra])
        cpu_rows = []
        for size in SIZES:
            measured = {m: [hop[m, size].cpu_per_gb(role) for role in ("sender", "middle", "receiver")] for m in MODES}
            per_gb = {m: [x for x in v if x is not None] for m, v in measured.items()}
            if all(len(v) == 3 for v in per_gb.values()):
                cpu_rows.append([size_label(size), *[x for m in MODES for x in (
                    "/".join(f"{v:.2f}" for v in per_gb[m]), sum(per_gb[m]))],
                    sum(per_gb["sparkbus"]) / sum(per_gb["zmq.proxy"])])
        cpu = Table("CPU-s per GB of payload: sender / middle / receiver (psutil, user + system)",
                    ["batch", *[x for m in MODES for x in (m, f"{m} sum")], "sparkbus / zmq.proxy"], cpu_rows,
                    [f"middle: the proxy process or the broker, both with {IO_THREADS} ZeroMQ I/O threads"])
        curve = Table("What CURVE costs (--auth; a cost, not a target)", ["batch", "plain MB/s", "plain b/s",
                      "CURVE MB/s", "CURVE b/s", "CURVE / plain"],
                      [[size_label(plain.size), plain.mb_per_s, plain.batches_per_s, secured.mb_per_s,
                        secured.batches_per_s, secured.mb_per_s / plain.mb_per_s]
                       for plain, secured in curve_pairs(result)])
        return [rates, diagnostics, cpu, curve]

    def json(self, run: Run, result: list[HopResult]) -> dict:
        return {"hop": [{"mode": h.mode, "size": h.size, "mb_per_s": h.mb_per_s, "batches_per_s": h.batches_per_s,
                         "runs": h.runs} for h in result],
                "curve": [{"size": plain.size, "plain_mb_per_s": plain.mb_per_s, "curve_mb_per_s": curve.mb_per_s,
                           "plain_batches_per_s": plain.batches_per_s, "curve_batches_per_s": curve.batches_per_s,
                           "ratio": curve.mb_per_s / plain.mb_per_s} for plain, curve in curve_pairs(result)]}
