"""An emulated multi-node cluster on one Linux machine: network namespaces as nodes.

    with EmulatedCluster(nodes=2, rate_mbit=200) as cluster:
        procs = [cluster.spawn(node, argv, env) for ...]

Topologies::

    bridge     node namespaces <prefix>n<i> joined by veth pairs to a bridge in the root
               namespace; every node's link is shaped on its egress (a NIC of
               rate_mbit each way). Ranks of one node talk over loopback (the kernel
               routes traffic to a local address over lo), so only inter-node bytes
               cross, and are counted on, the veth.
    full_mesh  every pair of nodes has its own veth link (own subnet), each shaped; a
               node's address lives on a dummy interface routed over the direct link
               to each peer. One rank per node: the TASP setting, where a single ring
               uses one link per rank and concurrent rings use them all.

Shaping is ``tc htb`` with bare ACKs served first, and inter-node routes acknowledge at
once (``QUICKACK``): a full-duplex NIC (see ``_shape``; netem delays are not available on
every kernel, so latency is left to the real stack). Needs root and iproute2:
:func:`check_requirements` says what is missing. Everything is torn down on exit, also
after errors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

def default_prefix() -> str:
    """Names of one cluster's namespaces and interfaces start with this: unique per process,
    so that clusters built at the same time on one machine (several benchmark runs, test
    sessions) neither share nor tear down each other's namespaces."""
    return f"e{os.getpid() % 100000}"
MTU = 9000  # fewer headers per byte: kernel counters stay close to payload bytes
# Inter-node routes carry ``quickack``: a receiver acknowledges every segment at once, as a
# bare ACK (which the shaping serves first), instead of delaying it and riding it on its
# own outgoing data. gloo carries both directions of a rank pair on one connection, so
# without this the ACKs of one direction sat in the other direction's data queue: each
# flow's RTT grew by that queue, slow start crept, and Ulysses 4 x ring on 2 nodes (four
# pairs exchanging both ways at once) took 1125-1170 ms at 60 Mbit/s, 1037-1077 with it
# (GQA, 3072 tokens; ring attention and StarTrail-2 unchanged). RDMA NICs acknowledge in
# hardware, at once.
QUICKACK = ("quickack", "1")


def inter_node_links() -> list[str]:
    """Inside a rank started by :meth:`EmulatedCluster.spawn`: its node's inter-node interfaces."""
    return [dev for dev in os.environ["INTER_NODE_LINKS"].split(",") if dev]


def node_tx_bytes(links: list[str]) -> int:
    """Inside a node's namespace: bytes sent so far on its interfaces ``links`` (the kernel's counters)."""
    total = 0
    for dev in links:
        with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
            total += int(f.read())
    return total


def check_requirements() -> str | None:
    """None if the cluster can be built here, else the reason."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs iproute2 ('{tool}' not found): apt-get install iproute2"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"'ip netns' does not work here: {probe.stderr.strip()}"
    return None


def _run(*cmd: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")


def _shape(ns: str, dev: str, rate_mbit: float) -> None:
    """Shape ``dev``'s egress to ``rate_mbit`` like a full-duplex NIC: HTB, with TCP's bare
    ACKs (IP packets under 128 bytes) in a class of their own served first.

    Why not one ``tbf`` queue (what this did before): the ACKs of the data a node
    receives leave through the same shaped egress as the data it sends, so they waited
    behind up to 100 ms of outgoing data, the senders' windows stalled and the link
    idled; tbf's queue also dropped ~20% of packets (TCP retransmits, 200 ms timeouts).
    On 2x4 at 25 Mbit/s (3.12 MB/s) one flow moved 2.1-2.5 MB/s one way per rank pair,
    1.8 both ways on one pair (the link probe, benchmarks/results/link_probe.md); with
    this (and ``QUICKACK``) 3.1 and 2.8, four flows 3.1 and 3.0, no packet dropped. A NIC of a GPU cluster is
    full duplex and its fabric lossless (InfiniBand credits, RoCE with PFC); this is
    closer to that. The ACKs still count against the rate (they borrow from the one
    parent class), with a 50th of it guaranteed. The priority class takes every IP
    packet under 128 bytes: bare ACKs, and also tiny data messages (an empty
    collective's), which a NIC would not favour.
    """
    tc = ("ip", "netns", "exec", ns, "tc")
    rate = f"{rate_mbit}mbit"
    # A bucket of at least a few packets; a few ms of traffic keeps the rate smooth.
    burst = max(4 * MTU, int(rate_mbit * 1e6 / 8 * 0.004))
    buckets = ("burst", str(burst), "cburst", str(burst))
    _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate, *buckets)
    for classid, share, prio in (("1:10", 1 / 50, "0"), ("1:20", 49 / 50, "1")):  # ACKs, data
        _run(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", classid, "htb",
             "rate", f"{rate_mbit * share:.6g}mbit", "ceil", rate, "prio", prio, *buckets)
    # Data queue: deep enough that TCP never loses a packet here (a lossless fabric).
    _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "bfifo", "limit", str(64 << 20))
    # IP total length (bytes 2-3 of the header) below 128: a bare ACK (SACK blocks included).
    _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
         "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10")


class EmulatedCluster:
    """``nodes`` namespaces; see the module docstring for the two topologies."""

    def __init__(self, nodes: int, rate_mbit: float | None, topology: str = "bridge", prefix: str | None = None) -> None:
        if topology not in ("bridge", "full_mesh"):
            raise ValueError(f"topology={topology!r}: use 'bridge' or 'full_mesh'")
        self.nodes, self.rate_mbit, self.topology = nodes, rate_mbit, topology
        self.prefix = prefix or default_prefix()
        if len(self.prefix) > 6:  # interface names: at most 15 characters
            raise ValueError(f"prefix {self.prefix!r} is longer than 6 characters")
        self.namespaces = [f"{self.prefix}n{i}" for i in range(nodes)]
        self._links: list[tuple[str, str]] = []  # (namespace, interface) whose tx counts as inter-node

    # -- addresses -------------------------------------------------------------------
    def address(self, node: int) -> str:
        """The address ranks of ``node`` bind gloo to (and rank 0's TCP store listens on)."""
        return f"10.78.0.{node + 1}" if self.topology == "bridge" else f"10.79.0.{node + 1}"

    def gloo_interface(self, node: int) -> str:
        return f"{self.prefix}v{node}" if self.topology == "bridge" else f"{self.prefix}h{node}"

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        reason = check_requirements()
        if reason:
            raise RuntimeError(reason)
        self.teardown()  # leftovers of an interrupted run
        try:
            for ns in self.namespaces:
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            (self._build_bridge if self.topology == "bridge" else self._build_mesh)()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _build_bridge(self) -> None:
        br = f"{self.prefix}br"
        _run("ip", "link", "add", br, "type", "bridge")
        _run("ip", "link", "set", br, "mtu", str(MTU), "up")
        for i, ns in enumerate(self.namespaces):
            inner, outer = f"{self.prefix}v{i}", f"{self.prefix}p{i}"
            _run("ip", "link", "add", inner, "mtu", str(MTU), "type", "veth", "peer", "name", outer, "mtu", str(MTU))
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", outer, "master", br, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            # The connected route again, acknowledging at once (see ``QUICKACK``).
            _run("ip", "-n", ns, "route", "replace", "10.78.0.0/24", "dev", inner, "proto", "kernel",
                 "scope", "link", "src", self.address(i), *QUICKACK)
            if self.rate_mbit:
                _shape(ns, inner, self.rate_mbit)
            self._links.append((ns, inner))

    def _build_mesh(self) -> None:
        for i, ns in enumerate(self.namespaces):
            # The node's own address lives on an unconnected veth pair (this kernel has no
            # dummy interfaces); peers reach it over their direct link (weak host model).
            host, spare = f"{self.prefix}h{i}", f"{self.prefix}hp{i}"
            _run("ip", "-n", ns, "link", "add", host, "type", "veth", "peer", "name", spare)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/32", "dev", host)
            _run("ip", "-n", ns, "link", "set", host, "up")
            _run("ip", "-n", ns, "link", "set", spare, "up")
        for i in range(self.nodes):
            for j in range(i + 1, self.nodes):
                a, b = f"{self.prefix}{i}x{j}", f"{self.prefix}{j}x{i}"
                _run("ip", "link", "add", a, "mtu", str(MTU), "netns", self.namespaces[i], "type", "veth",
                     "peer", "name", b, "mtu", str(MTU), "netns", self.namespaces[j])
                for node, dev, peer in ((i, a, j), (j, b, i)):
                    ns = self.namespaces[node]
                    _run("ip", "-n", ns, "link", "set", dev, "up")
                    # Reach the peer's address over the direct link, from our own address.
                    _run("ip", "-n", ns, "route", "add", f"{self.address(peer)}/32", "dev", dev,
                         "src", self.address(node), *QUICKACK)
                    if self.rate_mbit:
                        _shape(ns, dev, self.rate_mbit)
                    self._links.append((ns, dev))

    def teardown(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{self.prefix}br"], capture_output=True)
        for i in range(self.nodes):
            subprocess.run(["ip", "link", "del", f"{self.prefix}p{i}"], capture_output=True)
        self._links = []

    # -- use -------------------------------------------------------------------------
    def tx_bytes(self) -> dict[str, int]:
        """Bytes sent so far on every inter-node interface, read from the kernel."""
        out = {}
        for ns, dev in self._links:
            res = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", dev], capture_output=True, text=True)
            out[f"{ns}/{dev}"] = int(json.loads(res.stdout)[0]["stats64"]["tx"]["bytes"])
        return out

    def spawn(self, node: int, argv: list[str], env: dict[str, str], **popen) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace, gloo bound to its interface, with the
        names of the node's inter-node interfaces in ``INTER_NODE_LINKS`` (comma-separated)."""
        links = ",".join(dev for ns, dev in self._links if ns == self.namespaces[node])
        full_env = dict(os.environ, **env, GLOO_SOCKET_IFNAME=self.gloo_interface(node), INTER_NODE_LINKS=links)
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv], env=full_env, **popen)

    def run_ranks(self, ranks_per_node: int, argv: list[str], env: dict[str, str], port: int,
                  timeout: float = 600) -> None:
        """Run ``argv`` as every rank of a torch.distributed job over the cluster (rank r on
        node r // ranks_per_node, rendezvous on node 0), each with RANK, WORLD_SIZE,
        MASTER_ADDR, MASTER_PORT, RANKS_PER_NODE, OMP_NUM_THREADS=1 and ``env``; wait for
        all and raise if any failed."""
        world = self.nodes * ranks_per_node
        procs = [self.spawn(rank // ranks_per_node, argv, {
            "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": self.address(0), "MASTER_PORT": str(port),
            "RANKS_PER_NODE": str(ranks_per_node), "OMP_NUM_THREADS": "1", **env}) for rank in range(world)]
        codes = [proc.wait(timeout=timeout) for proc in procs]
        if any(codes):
            raise RuntimeError(f"ranks of {' '.join(argv[-2:])} failed with exit codes {codes}")
