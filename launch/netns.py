"""Hosts on one machine: network namespaces on a bridge, links that can be cut, a firewall that loses FIN/RST.

``Network(["spark", "broker", "ranks"])`` makes one namespace per host and a fourth holding a Linux bridge;
each host has ``eth0`` (a veth whose other end is a port of the bridge) with an address of the private test
range 10.213.0.0/24, which exists only inside these namespaces, and its loopback up. Nothing is added to the
root namespace. Every connection between two hosts crosses their interfaces and the bridge, so it can fail
the way a network does:

* :meth:`Network.cut` / :meth:`Network.restore` set the host's bridge port down / up: packets are lost both
  ways, the sockets at either end know nothing until their own timeouts say so.
* :meth:`Network.drop_fin_rst` / :meth:`Network.allow_fin_rst`: a filter on the host's ``eth0`` that drops
  every outgoing TCP packet with FIN or RST, as a firewall that forgot the connection does. A peer then holds
  the old connection until its own heartbeat timeout, even after the host closed it.

Namespaces are named ``sb-<pid>-<n>-<host>`` (pid of the process that made them). :meth:`Network.close` (and
leaving the ``with`` block, by an exception or Ctrl-C too) ends every process inside and deletes them; what a
killed process left behind is deleted by :func:`remove_leftovers`, which every new :class:`Network` runs first.

Needs root, ``ip`` and ``tc`` (iproute2): :func:`available` says whether this machine allows it, and why not.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

SUBNET = "10.213.0"          # /24; host i (from 0) gets SUBNET.(i+1)
PREFIX = "sb-"
INTERFACE = "eth0"           # each host's end of its link
BRIDGE = "br0"

# The FIN/RST filter, as classic BPF run by the ``bpf`` classifier in direct-action mode on the egress hook of
# ``clsact``: it returns TC_ACT_SHOT (2) to drop and TC_ACT_UNSPEC (-1) to let the packet go. (The u32 classifier
# with ``action drop`` needs the gact action module and a ``prio`` qdisc, which kernels without those modules do
# not have; cls_bpf and clsact are built in wherever tc works at all.) The packet starts at its Ethernet header.
_FIN_RST_BPF = ",".join([
    "9",
    "40 0 0 12",            # A = ethertype
    "21 0 6 2048",          # not IPv4 -> accept
    "48 0 0 23",            # A = IP protocol
    "21 0 4 6",             # not TCP -> accept
    "177 0 0 14",           # X = IP header length (4 * IHL)
    "80 0 0 27",            # A = TCP flags (Ethernet 14 + IP header X + 13)
    "69 0 1 5",             # FIN (0x01) or RST (0x04) set -> drop
    "6 0 0 2",              # drop: TC_ACT_SHOT
    "6 0 0 4294967295",     # accept: TC_ACT_UNSPEC (the next filter, none: send it)
])

_networks = itertools.count()
_HOST_NAME = re.compile(r"[a-z][a-z0-9]{0,15}")
_available: tuple[bool, str] | None = None
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class NetworkError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message has the command and what it printed."""


def _run(*argv: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def available() -> tuple[bool, str]:
    """Whether namespaces, veth pairs, a bridge and the FIN/RST filter can be made here.

    Returns:
        ``(True, "")``, or ``(False, reason)`` with what is missing (not root, no ``ip``/``tc``, or the kernel
        refused one of the steps, with its message). Probed once per process, in a namespace deleted after.
    """
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root (run the tests as root, or in a container that allows it)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool!r} (iproute2) is not installed"
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", name)
    except (NetworkError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot make a network namespace: {exc}"
    try:
        _run("ip", "-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        _run("ip", "-n", name, "link", "add", BRIDGE, "type", "bridge")
        _run("tc", "-n", name, "qdisc", "add", "dev", "probe0", "clsact")
        _run("tc", "-n", name, "filter", "add", "dev", "probe0", "egress", "bpf", "bytecode", _FIN_RST_BPF, "da")
    except (NetworkError, subprocess.TimeoutExpired) as exc:
        return False, f"this kernel does not allow a step of the test network: {exc}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return True, ""


def namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces that start with ``prefix``."""
    listed = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces ``sb-<pid>-...`` whose maker (pid) is no longer running, and end the processes inside.

    What a test process killed without its teardown left behind; namespaces of running test processes (another
    suite on this machine) are left alone. Returns the names deleted.
    """
    removed = []
    for name in namespaces(prefix):
        owner = re.match(re.escape(prefix) + r"(\d+)-", name)
        if owner and not _running(int(owner.group(1))):
            _end_processes(name, grace=0.0)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pids_in(namespace: str) -> list[int]:
    listed = _run("ip", "netns", "pids", namespace, check=False).stdout
    return [int(p) for p in listed.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"     # a zombie has ended, only its exit status is left
    except (OSError, IndexError):
        return False


def _end_processes(namespace: str, grace: float) -> None:
    """SIGTERM every process in ``namespace``, SIGKILL those left after ``grace`` s (and any started meanwhile)."""
    deadline = time.monotonic() + grace
    signalled: set[int] = set()
    while True:
        pids = [p for p in _pids_in(namespace) if _alive(p)]
        if not pids:
            return
        now = time.monotonic()
        if now > deadline + 5:
            raise NetworkError(f"processes {pids} in namespace {namespace} survive SIGKILL")
        for pid in pids:
            if now > deadline or pid not in signalled:
                try:
                    os.kill(pid, signal.SIGKILL if now > deadline else signal.SIGTERM)
                except ProcessLookupError:
                    pass
                signalled.add(pid)
        time.sleep(0.05)


def _die_with_parent() -> None:
    # In the child, before exec: SIGTERM when the thread that started it ends (its process killed, even by -9).
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Network:
    """Hosts (network namespaces) on one bridge. Use as a context manager, or :meth:`start` and :meth:`close`.

    Args:
        hosts: host names (lowercase letters and digits, up to 16); host ``hosts[i]`` gets address
            ``10.213.0.(i+1)``.
        subnet: the first three octets of the /24 the hosts share.

    Raises:
        NetworkError: a namespace, link or address could not be made (see :func:`available`); what had been
            made is deleted.
    """

    def __init__(self, hosts: Sequence[str], subnet: str = SUBNET):
        hosts = list(hosts)
        bad = [h for h in hosts if not _HOST_NAME.fullmatch(h) or h == "bridge"]
        if bad or len(set(hosts)) != len(hosts) or not 0 < len(hosts) < 250:
            raise ValueError(f"host names must be distinct, [a-z][a-z0-9]{{0,15}} and not 'bridge': {hosts}")
        self.hosts = hosts
        self.subnet = subnet
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_networks)}-"
        self.bridge = f"{self.prefix}bridge"
        self._made: list[str] = []
        self._children: list[subprocess.Popen] = []

    # ---- names and addresses ------------------------------------------------------------------------------

    def namespace(self, host: str) -> str:
        """The network namespace of ``host`` (for ``ip netns exec``)."""
        self._index(host)
        return f"{self.prefix}{host}"

    def address(self, host: str) -> str:
        """The IPv4 address of ``host``, e.g. ``10.213.0.2`` for the second host."""
        return f"{self.subnet}.{self._index(host) + 1}"

    def _index(self, host: str) -> int:
        try:
            return self.hosts.index(host)
        except ValueError:
            raise KeyError(f"no host {host!r} in this network (hosts: {', '.join(self.hosts)})") from None

    def _port(self, host: str) -> str:
        return f"port{self._index(host)}"         # the host's link, seen from the bridge

    # ---- lifetime -----------------------------------------------------------------------------------------

    def start(self) -> Network:
        """Make the bridge and the hosts (after deleting what dead test processes left behind)."""
        remove_leftovers()
        try:
            self._add_namespace(self.bridge)
            _run("ip", "-n", self.bridge, "link", "add", BRIDGE, "type", "bridge")
            _run("ip", "-n", self.bridge, "link", "set", BRIDGE, "up")
            for host in self.hosts:
                ns, port = self.namespace(host), self._port(host)
                self._add_namespace(ns)
                # Both ends are made inside the namespaces: the root namespace never holds either, even briefly.
                _run("ip", "-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", INTERFACE,
                     "netns", ns)
                _run("ip", "-n", self.bridge, "link", "set", port, "master", BRIDGE, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", INTERFACE)
                _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def close(self, grace: float = 3.0) -> None:
        """End every process in the hosts (SIGTERM, SIGKILL after ``grace`` s) and delete the namespaces.

        Safe to call twice; the veth pairs and the bridge go with their namespaces.
        """
        errors = []
        for name in reversed(self._made):
            try:
                _end_processes(name, grace)
            except NetworkError as exc:
                errors.append(str(exc))
        for child in self._children:      # reap what we started (its zombie would otherwise stay)
            try:
                child.wait(timeout=1)
            except subprocess.TimeoutExpired:
                errors.append(f"pid {child.pid} did not end")
        for name in reversed(self._made):
            done = _run("ip", "netns", "del", name, check=False)
            if done.returncode != 0:
                errors.append(f"cannot delete namespace {name}: {done.stderr.strip()}")
        self._made.clear()
        self._children.clear()
        if errors:
            raise NetworkError("; ".join(errors))

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- processes ----------------------------------------------------------------------------------------

    def popen(self, host: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (``ip netns exec``), in a session of its own so its group can be signalled.

        The process gets SIGTERM if the thread that called this ends (call it from the main thread), and is
        ended by :meth:`close` or :meth:`end_processes` whatever it started, sessions of their own included.

        Args:
            popen: :class:`subprocess.Popen` arguments (``env``, ``stdout``, ``stderr``, ``cwd``, ...); stdin is
                ``/dev/null`` unless given.
        """
        popen.setdefault("stdin", subprocess.DEVNULL)
        child = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], start_new_session=True,
                                 preexec_fn=_die_with_parent, **popen)
        self._children.append(child)
        return child

    def run(self, host: str, argv: Sequence[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
        """Run a short command on ``host`` and return it (text output); raises NetworkError if it fails."""
        return _run("ip", "netns", "exec", self.namespace(host), *argv, timeout=timeout)

    def pids(self, host: str) -> list[int]:
        """The live processes on ``host``."""
        return [p for p in _pids_in(self.namespace(host)) if _alive(p)]

    def end_processes(self, host: str, grace: float = 3.0) -> None:
        """SIGTERM every process on ``host``, SIGKILL what is left after ``grace`` s (MPI ranks, JVMs included)."""
        _end_processes(self.namespace(host), grace)
        for child in self._children:
            child.poll()

    # ---- faults -------------------------------------------------------------------------------------------

    def cut(self, host: str) -> None:
        """Cut ``host``'s link: its bridge port goes down, every packet to or from it is lost until restored."""
        _run("ip", "-n", self.bridge, "link", "set", self._port(host), "down")

    def restore(self, host: str) -> None:
        """Bring ``host``'s link back (the bridge forwards at once: no spanning tree)."""
        _run("ip", "-n", self.bridge, "link", "set", self._port(host), "up")

    def is_cut(self, host: str) -> bool:
        shown = json.loads(_run("ip", "-n", self.bridge, "-j", "link", "show", self._port(host)).stdout)
        return "UP" not in shown[0]["flags"]

    def drop_fin_rst(self, host: str) -> None:
        """Drop every TCP packet with FIN or RST that ``host`` sends, until :meth:`allow_fin_rst`.

        Its peers never learn that a connection closed: they hold it until their own timeouts.
        """
        ns = self.namespace(host)
        if not self.drops_fin_rst(host):
            _run("tc", "-n", ns, "qdisc", "add", "dev", INTERFACE, "clsact")
            _run("tc", "-n", ns, "filter", "add", "dev", INTERFACE, "egress", "bpf", "bytecode", _FIN_RST_BPF,
                 "da")

    def allow_fin_rst(self, host: str) -> None:
        """Remove the FIN/RST filter of ``host`` (nothing happens if there is none)."""
        if self.drops_fin_rst(host):
            _run("tc", "-n", self.namespace(host), "qdisc", "del", "dev", INTERFACE, "clsact")

    def drops_fin_rst(self, host: str) -> bool:
        shown = _run("tc", "-n", self.namespace(host), "qdisc", "show", "dev", INTERFACE).stdout
        return "clsact" in shown

    def heal(self) -> None:
        """Every link up and no filter: undo whatever faults a test left."""
        for host in self.hosts:
            self.restore(host)
            self.allow_fin_rst(host)

    # ---- figures ------------------------------------------------------------------------------------------

    def link_bytes(self, host: str) -> tuple[int, int]:
        """Bytes ``(received, sent)`` on ``host``'s interface since it was made."""
        shown = json.loads(_run("ip", "-n", self.namespace(host), "-s", "-j", "link", "show", INTERFACE).stdout)
        stats = shown[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]


__all__ = ["Network", "NetworkError", "available", "namespaces", "remove_leftovers", "SUBNET"]
