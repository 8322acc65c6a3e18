"""The processes of a measurement: senders, receivers, ranks and the ``zmq.proxy`` anchor, each a fresh interpreter
(``multiprocessing`` spawn) that reports over a pipe. Times are ``time.time()``, comparable across processes."""

from __future__ import annotations

import multiprocessing
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

SENTINEL = b""          # a one-frame message ends a raw ZeroMQ run
IO_THREADS = 2          # as many ZeroMQ I/O threads as the broker's (one for the feed side, one for the ranks')


class Agent:
    """A child process running ``target(report, *args)``; ``report(x)`` sends ``x`` to the parent."""

    def __init__(self, target: Callable[..., Any], *args: Any):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_run, args=(child, target, args), daemon=True)
        self.proc.start()

    def get(self, timeout: float, what: str) -> Any:
        """The next thing the child reported; raises if it failed, exited or said nothing in ``timeout`` s."""
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{what}: nothing within {timeout:g} s (exit status {self.proc.exitcode})")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"{what} failed:\n{value}")
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def _run(conn: Any, target: Callable[..., Any], args: tuple) -> None:
    from sparkbus.launch.processes import die_with_parent

    die_with_parent()
    try:
        target(lambda value: conn.send(("ok", value)), *args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def hwm(size: int) -> int:
    """A raw socket's queue: about 64 MiB, between 16 and 1000 messages."""
    return max(16, min(1000, (64 << 20) // size))


def batches(size: int, seconds: float, min_batches: int, clock: dict) -> Iterator[dict]:
    """The same one-column batch of ``size`` bytes, until ``seconds`` passed and ``min_batches`` were given."""
    import numpy as np

    columns = {"x": np.random.default_rng(size).random(size // 4, dtype=np.float32)}
    cpu = time.process_time()
    clock["first"] = started = time.time()
    n = 0
    while n < min_batches or time.time() - started < seconds:
        yield columns
        n += 1
    clock["sent"], clock["cpu"] = n, time.process_time() - cpu        # the sender's CPU-s, its start-up left out


def sender(report: Callable, way: str, address: str, control: str, stream: str, size: int, seconds: float,
           min_batches: int, timeout: float, partition: int = 0, options: dict | None = None) -> None:
    """Send for ``seconds`` (and ``min_batches``): through sparkbus's feeder path (``options``: more arguments of
    ``stream_partition``, e.g. ``pack_bytes``, ``key``), or the same encoded message over a raw PUSH."""
    clock: dict = {}
    if way == "sparkbus":
        from sparkbus.feeder.task import stream_partition

        stream_partition(batches(size, seconds, min_batches, clock), address, control, stream, 0, partition, 0,
                         timeout, **(options or {}))
    else:
        import zmq

        from sparkbus.wire.codec import encode_batch

        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.sndhwm = hwm(size)
        push.connect(address)
        frames = None
        for columns in batches(size, seconds, min_batches, clock):
            frames = frames or encode_batch("raw", 0, 0, 0, columns)       # sparkbus's very message, encoded once
            push.send_multipart(frames, copy=False)
        push.send(SENTINEL)
        push.close(linger=int(timeout * 1000))
        ctx.term()
    report(clock)


def receiver(report: Callable, way: str, address: str, stream: str, size: int, timeout: float,
             options: dict | None = None) -> None:
    """Receive one run: a ``BatchStream`` epoch (``options``: more of its arguments, e.g. ``key``), or a raw PULL
    until the sentinel; report count and last time."""
    n, last = 0, None
    if way == "sparkbus":
        from sparkbus.worker import BatchStream

        with BatchStream(address, stream=stream, comm=None, timeout=timeout, **(options or {})) as s:
            report("ready")
            for _ in s.epoch():
                n, last = n + 1, time.time()
    else:
        import zmq

        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.rcvhwm = hwm(size)
        pull.connect(address)
        report("ready")
        while True:
            if not pull.poll(int(timeout * 1000)):
                raise TimeoutError(f"no message for {timeout:g} s after {n}")
            if len(pull.recv_multipart(0, size < 64 << 10)) == 1:      # small ones faster copied
                break
            n, last = n + 1, time.time()
        pull.close(linger=0)
        ctx.term()
    report({"received": n, "last": last})


def proxy(report: Callable, size: int) -> None:
    """``zmq.proxy(PULL, PUSH)``: the C broker, the limit for a hop, its queues as the raw sockets' for batches of
    ``size`` bytes; forwards until terminated."""
    import zmq

    ctx = zmq.Context(io_threads=IO_THREADS)
    front, back = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (front, back):
        sock.rcvhwm = sock.sndhwm = hwm(size)
        sock.bind("tcp://127.0.0.1:*")
    report({"front": front.getsockopt_string(zmq.LAST_ENDPOINT), "back": back.getsockopt_string(zmq.LAST_ENDPOINT)})
    zmq.proxy(front, back)


def rank(report: Callable, address: str, stream: str, rank: int, size: int, timeout: float,
         files: list[str] | None, go: str | None) -> None:
    """One of ``size`` ranks: its share of one epoch from the broker, or (``files``) of staged Parquet files read
    with pyarrow in batches of 1024 rows once the ``go`` file exists. Reports rows, first and last batch times and
    its CPU seconds from then."""
    rows, first, last = 0, None, None
    if files is None:
        from sparkbus.worker import BatchStream

        with BatchStream(address, stream=stream, rank=rank, size=size, timeout=timeout) as s:
            report("ready")
            cpu = time.process_time()
            for batch in s.epoch():
                rows += len(next(iter(batch.values())))
                last = time.time()
                first = first or last
    else:
        import glob
        import os

        import pyarrow.parquet as pq

        report("ready")
        cpu = time.process_time()
        deadline = time.time() + timeout
        while not os.path.exists(go or ""):
            if time.time() > deadline:
                raise TimeoutError("the staged files never came")
            time.sleep(0.005)
        for path in sorted(glob.glob(os.path.join(files[0], "*.parquet")))[rank::size]:
            for record_batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                columns = {name: col.to_numpy(zero_copy_only=False) for name, col in
                           zip(record_batch.schema.names, record_batch.columns)}
                rows += len(next(iter(columns.values())))
                last = time.time()
                first = first or last
    report({"rows": rows, "first": first, "last": last, "cpu": time.process_time() - cpu})
