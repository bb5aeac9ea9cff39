"""A private, rate-limited network for the ranks: one namespace per machine, joined by a bridge.

Layout for a run with id ``ID`` (process id plus a random suffix, so concurrent runs never
collide) and ``N`` machines of ``G`` ranks each::

    namespace commhooks-ID-m (ranks m*G .. m*G+G-1)    host side
    [bench0 198.18.x.(m+1)/24] ==veth== [chvIDm] --- bridge chbID

A machine is a namespace: its ranks share its address, and what they send one another goes
to a local address, over the namespace's own loopback, never over the veth (the inside of a
machine is free, as NVLink or shared memory next to a network link). What crosses machines
crosses the machine's one link.

Every link is limited in both directions with ``tc tbf`` on its egress: inside the namespace
(what the machine sends) and on the host end (what the bridge delivers to it). Segmentation
offload stays on, as on a real NIC: TCP hands the link packets of up to 64 KiB, which ``tbf``
charges (and counts) as the wire-sized segments they become, headers included. Without it
the kernel cuts and reassembles every 1500-byte packet in software, on the very cores that
train, and the emulated link delivers far less than its rate: on a 2-core machine a 1 Gbit/s
link moved 250-400 Mbit/s (700-900 with offload), and a 64 KiB exchange took 3 ms longer.
``offload=False`` (``--no-offload``) restores that per-packet processing, as of a NIC
without offload.

The addresses come from the benchmarking range 198.18.0.0/15, a random /24 per run; the
bridge has no address and no other port, so nothing reaches, or comes from, any other network.

``--latency`` adds a one-way delay between two machines with ``netem`` (half on each link),
when the kernel has it; ``tbf``'s own ``latency`` parameter is only the bound on its queue, not
a delay, so without netem a latency request is refused rather than silently ignored.

Everything is removed by :meth:`Network.close`, which :meth:`Network.__exit__`, an ``atexit``
handler and the SIGINT/SIGTERM handlers installed while the network exists all call.
"""

import atexit
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = [
    "Network",
    "NetworkError",
    "burst_bytes",
    "check_can_create",
    "enter_namespace",
    "link_counters",
]

IFACE = "bench0"  # the machine's interface name inside its own namespace
_PREFIX = "commhooks-"


def burst_bytes(rate_bps: float, mtu: int = 1500) -> int:
    """The token bucket of a link of ``rate_bps``: about 2 ms at the rate, at least a few full
    packets. It keeps bursts short, and lets a link reach its rate (a bucket of a quarter
    of a millisecond carried 78% of 1 Gbit/s, against 96% with this one); the cost model
    counts what it lets through at once after an idle spell (``costmodel.Link.burst_bytes``).
    """
    return max(4 * (mtu + 14), int(rate_bps) // 8 // 500)


class NetworkError(RuntimeError):
    """The private network cannot be created here (not root, no ``ip``/``tc``, no netem...)."""


def check_can_create(latency_s: float = 0.0) -> None:
    """Raise ``NetworkError`` with the fix when namespaces and tc cannot be used."""
    if not os.uname().sysname == "Linux":
        raise NetworkError("--bandwidth needs Linux network namespaces; run without --bandwidth.")
    if os.geteuid() != 0:
        raise NetworkError(
            "--bandwidth needs root: it creates network namespaces, veth links and tc rate "
            "limits. Run it as root (e.g. `sudo commhooks bench --bandwidth 100mbit`), or drop "
            "--bandwidth/--sweep for an unlimited loopback run."
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetworkError(f"--bandwidth needs the `{tool}` command (package iproute2).")
    if latency_s > 0:
        _probe_netem()


def _probe_netem() -> None:
    """Try netem on the loopback of a throw-away namespace, so --latency fails before any run."""
    ns = f"{_PREFIX}probe-{os.getpid():x}{secrets.token_hex(2)}"
    try:
        _run("ip", "netns", "add", ns)
        _run("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    except NetworkError as exc:
        raise NetworkError(
            "--latency needs the netem qdisc (kernel module sch_netem), which this kernel does "
            "not provide; run without --latency: tbf alone limits the rate (its own 'latency' "
            f"parameter only bounds its queue, it adds no delay). Detail: {exc}"
        ) from None
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetworkError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")


class Network:
    """Create the namespaces, links and limits on entry; remove all of it on exit.

    ``machines`` namespaces, each the machine of ``per_node`` consecutive ranks, each with one
    link of ``rate_bps``. Per machine: :attr:`namespaces`, :attr:`host_ends`,
    :attr:`addresses`; per rank: :meth:`rank_namespaces`, :meth:`rank_host_ends`.
    """

    def __init__(
        self,
        machines: int,
        rate_bps: int,
        latency_s: float = 0.0,
        mtu: int = 1500,
        offload: bool = True,
        per_node: int = 1,
    ):
        self.machines = machines
        self.per_node = per_node
        self.offload = offload
        self.rate_bps = rate_bps
        self.latency_s = latency_s
        self.mtu = mtu
        # The whole process id (at most 6 hex digits) and a random part: unique among running
        # processes, and "chv" + 10 + a two-digit machine fits a 15-character interface name.
        self.run_id = f"{os.getpid():x}{secrets.token_hex(2)}"
        block = secrets.randbelow(512)  # a random /24 inside 198.18.0.0/15
        self.subnet = f"198.{18 + block // 256}.{block % 256}"
        self.bridge = f"chb{self.run_id}"
        self.namespaces = [f"{_PREFIX}{self.run_id}-{m}" for m in range(machines)]
        self.host_ends = [f"chv{self.run_id}{m}" for m in range(machines)]
        self.addresses = [f"{self.subnet}.{m + 1}" for m in range(machines)]
        self._created = False
        # What this run made, so that cleaning up never touches a name someone else holds.
        self._made_namespaces: list[str] = []
        self._made_links: list[str] = []
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    @property
    def world_size(self) -> int:
        """The ranks the network holds: every machine's."""
        return self.machines * self.per_node

    def rank_namespaces(self) -> list[str]:
        """Per rank, the namespace of its machine (what :func:`enter_namespace` takes)."""
        return [self.namespaces[r // self.per_node] for r in range(self.world_size)]

    def rank_host_ends(self) -> list[str]:
        """Per rank, the host end of its machine's link, whose counters the rank reads: every
        rank of a machine reads the same link, the machine's."""
        return [self.host_ends[r // self.per_node] for r in range(self.world_size)]

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "Network":
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Create everything; on any failure remove what was created and raise."""
        check_can_create(self.latency_s)
        self._created = True
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove namespaces and links (idempotent; never raises)."""
        if not self._created:
            return
        self._created = False
        for ns in self._made_namespaces:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)  # our own rank processes, by id
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in reversed(self._made_links):  # veth ends before the bridge they are on
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self._made_namespaces.clear()
        self._made_links.clear()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        atexit.unregister(self.close)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    # -- construction ------------------------------------------------------------------------

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for ns, host, addr in zip(self.namespaces, self.host_ends, self.addresses):
            _run("ip", "netns", "add", ns)
            self._made_namespaces.append(ns)
            _run(
                "ip",
                "link",
                "add",
                host,
                "mtu",
                str(self.mtu),
                "type",
                "veth",
                "peer",
                "name",
                IFACE,
                "mtu",
                str(self.mtu),
                "netns",
                ns,
            )
            self._made_links.append(host)
            _run("ip", "link", "set", host, "master", self.bridge)
            _run("ip", "link", "set", host, "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            _run("ip", "-n", ns, "link", "set", IFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if not self.offload:  # every packet wire-sized from the socket on (see above)
                for cmd in (["ip", "-n", ns], ["ip"]):
                    dev = IFACE if len(cmd) > 1 else host
                    subprocess.run(
                        [*cmd, "link", "set", dev, "gso_max_size", str(self.mtu)],
                        capture_output=True,
                    )
            self._limit(["tc", "-n", ns], IFACE)
            self._limit(["tc"], host)

    def _limit(self, tc: list[str], dev: str) -> None:
        rate = f"{self.rate_bps}bit"
        # A 100 ms queue absorbs TCP's bursts without drops that would waste the link.
        burst = burst_bytes(self.rate_bps, self.mtu)
        limit = ["rate", rate, "burst", str(burst), "latency", "100ms"]
        if self.latency_s <= 0:
            _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", *limit)
            return
        delay = f"{self.latency_s / 2 * 1e6:.0f}us"
        try:
            _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay)
        except NetworkError as exc:
            raise NetworkError(
                "--latency needs the netem qdisc (kernel module sch_netem), which this kernel "
                "does not provide; run without --latency (tbf alone limits the rate, its queue "
                f"bound is not a delay). Detail: {exc}"
            ) from None
        _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", "tbf", *limit)

    # -- use ---------------------------------------------------------------------------------

    def command(self, machine: int) -> list[str]:
        """The prefix that runs a command inside machine ``machine``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[machine]]

    def env(self) -> dict[str, str]:
        """Environment that binds gloo to each machine's interface in its namespace: the ranks
        of one machine reach one another at its own address, over its loopback."""
        return {"GLOO_SOCKET_IFNAME": IFACE, "MASTER_ADDR": self.addresses[0]}

    def leftovers(self) -> list[str]:
        """Names of this run's namespaces and links that still exist (empty after close)."""
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        found = [n for n in self.namespaces if n in ns.split()]
        found += [
            n for n in [*self.host_ends, self.bridge] if f" {n}:" in links or f" {n}@" in links
        ]
        return found


# -- inside a rank ----------------------------------------------------------------------------


def enter_namespace(namespaces: list[str], rank: int) -> None:
    """Move this process into ``namespaces[rank]`` (its machine's network namespace), before it
    opens any socket.

    Called in a freshly forked, single-threaded rank process (``setns`` refuses a process
    with several threads).
    """
    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespaces[rank]}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {namespaces[rank]}")
    finally:
        os.close(fd)


def link_counters(host_end: str | None) -> dict[str, int] | None:
    """The machine's sent and received bytes and wire-sized packets so far over its link;
    ``None`` on loopback.

    Sent traffic is read from the rate limiter on the machine's link, which counts every
    segment that goes on the wire with its headers, whether or not TCP handed it over as one
    offloaded packet; what the machine's ranks send one another never reaches it. Received
    traffic is what the host end of the link delivered to the machine (its transmit counters).
    Without ``tc`` statistics both come from the host end. Call it from inside the machine's
    namespace.
    """
    if not host_end:
        return None
    base = f"/sys/class/net/{host_end}/statistics/"

    def host_end_count(name: str) -> int:
        with open(f"{base}{name}") as f:
            return int(f.read())

    sent = _limiter_counts()
    if sent is None:  # what the host end received is what the rank sent
        sent = (host_end_count("rx_bytes"), host_end_count("rx_packets"))
    return {
        "tx_bytes": sent[0],
        "tx_packets": sent[1],
        "rx_bytes": host_end_count("tx_bytes"),
        "rx_packets": host_end_count("tx_packets"),
    }


def _limiter_counts() -> tuple[int, int] | None:
    """Bytes and packets through the root qdisc of this namespace's link, if ``tc`` says."""
    try:
        done = subprocess.run(
            ["tc", "-s", "-j", "qdisc", "show", "dev", IFACE],
            capture_output=True,
            text=True,
            timeout=30,
        )
        qdiscs = json.loads(done.stdout) if done.returncode == 0 else []
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    for q in qdiscs:
        if q.get("root") and "bytes" in q and "packets" in q:
            return int(q["bytes"]), int(q["packets"])
    return None
