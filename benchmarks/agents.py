"""Processes of the hop and RSS measurements (``multiprocessing`` spawn, driven by jobs on a pipe): :func:`sender`
(raw pyzmq, or ``feeder.task.stream_partition``), :func:`receiver` (a raw PULL, or ``BatchStream(comm=None)``) and
:func:`proxy` (``zmq.proxy``, the C broker). Times are ``time.time()``, comparable across the processes."""

from __future__ import annotations

import time
from typing import Any

from sparkbus.launch.processes import die_with_parent

from .common import agent_loop

SENTINEL = b""       # a one-frame message ends a raw zmq measurement


def payload(size: int, dtype: str = "float32") -> dict:
    """One batch: a single column of ``size`` bytes."""
    import numpy as np

    itemsize = np.dtype(dtype).itemsize
    rng = np.random.default_rng(size)
    return {"x": (rng.random(size // itemsize) * 100).astype(dtype)}


def _timed(columns: dict, seconds: float, min_batches: int, max_batches: int | None, clock: dict):
    """Yield the same batch until ``seconds`` have passed (and at least ``min_batches``), or ``max_batches``."""
    clock["t_first"] = started = time.time()
    n = 0
    while True:
        yield columns
        n += 1
        if max_batches is not None and n >= max_batches:
            break
        if n >= min_batches and time.time() - started >= seconds:
            break
    clock["sent"] = n


# ---- sender -------------------------------------------------------------------------------------------------

def sender(conn: Any) -> None:
    agent_loop(conn, _send_job)


def _send_job(conn: Any, job: dict) -> dict:
    if job.get("no_checksum"):     # investigation only (profile_hop.py --no-checksum): what the checksum costs
        from sparkbus.wire import protocol

        for name in ("batch_checksum", "batch_crc"):       # whichever this protocol version has
            if hasattr(protocol, name):
                setattr(protocol, name, lambda buffers: 0)
    columns = payload(job["size"])
    clock: dict = {}
    batches = _timed(columns, job["seconds"], job["min_batches"], job.get("max_batches"), clock)
    if job["mode"] == "zmq":
        _send_zmq(job, batches)
    else:
        from sparkbus.feeder.task import stream_partition

        more = {"pack_bytes": job["pack_bytes"]} if "pack_bytes" in job else {}     # a diagnostic's setting
        more |= {k: job[k] for k in ("key", "broker_key") if k in job}              # CURVE (a broker with --auth)
        stream_partition(batches, job["feed"], job["control"], job["stream"], job.get("epoch", 0),
                         job.get("partition", 0), 0, job.get("timeout", 60.0), **more)
    clock["t_done"] = time.time()
    return clock


def _send_zmq(job: dict, batches) -> None:
    import zmq

    from sparkbus.wire.codec import encode_batch

    ctx: Any = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.linger = -1                      # the sentinel must leave before close returns
    push.sndhwm = job["hwm"]
    push.connect(job["address"])
    try:
        frames = None
        for columns in batches:
            if frames is None:            # the very message sparkbus sends, encoded once: header + column
                frames = encode_batch("raw", 0, 0, 0, columns)
            push.send_multipart(frames, copy=False)
        push.send(SENTINEL)
    finally:
        push.close(linger=int(job.get("timeout", 60.0) * 1000))


# ---- receiver -----------------------------------------------------------------------------------------------

def receiver(conn: Any) -> None:
    agent_loop(conn, _receive_job)


def _receive_job(conn: Any, job: dict) -> dict:
    if job["mode"] == "zmq":
        return _receive_zmq(conn, job)
    return _receive_sparkbus(conn, job)


def _receive_zmq(conn: Any, job: dict) -> dict:
    import zmq

    ctx: Any = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.rcvhwm = job["hwm"]
    copy = job["size"] < 64 * 1024        # small messages are faster copied into bytes
    try:
        if job.get("address"):
            pull.connect(job["address"])
            endpoint = job["address"]
        else:
            pull.bind("tcp://127.0.0.1:*")
            endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        conn.send(("ok", {"endpoint": endpoint}))          # ready: the parent may start the sender
        n, t_last, t_first = 0, None, None
        deadline_ms = int(job.get("timeout", 60.0) * 1000)
        while True:
            if not pull.poll(deadline_ms):
                raise TimeoutError(f"no message for {deadline_ms / 1000:g} s after {n} messages")
            frames = pull.recv_multipart(copy=copy)
            if len(frames) == 1:
                break
            t_last = time.time()
            if t_first is None:
                t_first = t_last
            n += 1
        return {"received": n, "t_last": t_last, "t_first_recv": t_first}
    finally:
        pull.close(linger=0)


def _receive_sparkbus(conn: Any, job: dict) -> dict:
    from sparkbus.worker import BatchStream

    keys = {k: job[k] for k in ("key", "broker_key") if k in job}                  # CURVE (a broker with --auth)
    with BatchStream(job["ranks"], stream=job["stream"], comm=None, prefetch=job.get("prefetch", 4),
                     verify=job.get("verify", True), timeout=job.get("timeout", 60.0), **keys) as stream:
        conn.send(("ok", {"endpoint": job["ranks"]}))      # joined: the parent may start the feed
        n, t_last, t_first = 0, None, None
        for _batch in stream.epoch():
            t_last = time.time()
            if t_first is None:
                t_first = t_last
            n += 1
        ep = stream.stats.epochs[-1]
        return {"received": n, "t_last": t_last, "t_first_recv": t_first, "bytes": ep.bytes,
                "wait_seconds": ep.wait_seconds, "seconds": ep.seconds}


# ---- zmq.proxy -------------------------------------------------------------------------------------------------

def proxy(conn: Any, hwm: int) -> None:
    """Bind PULL and PUSH on free loopback ports, report them, then forward forever (the parent terminates us).

    Its context has as many I/O threads as the broker's, so that the two hops copy bytes on as many threads."""
    import zmq

    from sparkbus.broker.daemon import IO_THREADS

    die_with_parent()
    ctx = zmq.Context(io_threads=IO_THREADS)
    front, back = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (front, back):
        sock.linger = 0
        sock.rcvhwm = sock.sndhwm = hwm
        sock.bind("tcp://127.0.0.1:*")
    conn.send(("ok", {"front": front.getsockopt_string(zmq.LAST_ENDPOINT),
                      "back": back.getsockopt_string(zmq.LAST_ENDPOINT)}))
    zmq.proxy(front, back)
