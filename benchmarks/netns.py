"""Two "nodes" on one machine: network namespaces joined by a veth pair shaped with ``tc``.

::

    namespace <prefix>-n0                                  namespace <prefix>-n1
    +------------------------+                             +------------------------+
    | lo (fast, intra-node)  |                             | lo (fast, intra-node)  |
    | <prefix>a 10.77.0.1 ---+-- tbf <rate> === tbf <rate> --+- <prefix>b 10.77.0.2 |
    +------------------------+       the only inter-node   +------------------------+
                                     link, both directions

Traffic between two processes of one namespace goes through that namespace's loopback even when they address each
other by the veth IP (Linux routes local addresses via ``lo``), so only inter-node bytes cross the shaped veth,
as inter-node traffic crosses a cluster's NICs while NVLink carries the traffic inside a node.

``TwoNodeCluster`` is a context manager: it refuses clearly without root or ``ip``/``tc``, and on exit (normal,
exception, or a signal turned into ``SystemExit`` by ``exit_on_signals``) kills every process it started, with
their children, and deletes both namespaces (which destroys the veth pair). Namespaces left behind by a killed
invocation (``SIGKILL``) carry its pid in their name and are removed by the next one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

ADDRESSES = ("10.77.0.1", "10.77.0.2")
_NAME = re.compile(r"^zpp(\d+)-n[01]$")


def missing_requirements() -> str | None:
    """Why the cluster cannot be built here, or ``None`` if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth and tc); run it as root or with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (Debian: apt-get install iproute2)"
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_stale_namespaces() -> list[str]:
    """Deletes namespaces of earlier invocations whose process no longer exists; returns their names."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace_processes(name)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


class TwoNodeCluster:
    """Two namespaces joined by one veth pair; each end's egress limited to ``rate_mbit`` (``None``: unshaped).

    Args:
        rate_mbit: link rate in Mbit/s, each direction; ``None`` leaves the veth unshaped.
        delay_ms: one-way delay added on each end (needs the kernel's ``sch_netem``); 0 for none.
    """

    def __init__(self, rate_mbit: float | None = 200.0, delay_ms: float = 0.0) -> None:
        self.prefix = f"zpp{os.getpid()}"
        self.namespaces = (f"{self.prefix}-n0", f"{self.prefix}-n1")
        self.interfaces = (f"{self.prefix}a", f"{self.prefix}b")
        self.addresses = ADDRESSES
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self._procs: list[subprocess.Popen] = []
        self._up = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> TwoNodeCluster:
        reason = missing_requirements()
        if reason:
            raise PermissionError(f"TwoNodeCluster {reason}.")
        remove_stale_namespaces()
        try:
            self._up = True
            for ns in self.namespaces:
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            a, b = self.interfaces
            _run("ip", "link", "add", a, "netns", self.namespaces[0], "type", "veth", "peer", "name", b, "netns",
                 self.namespaces[1])  # fmt: skip
            for ns, dev, addr in zip(self.namespaces, self.interfaces, self.addresses, strict=True):
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
            self.shape(self.rate_mbit, self.delay_ms)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kills what this cluster started and deletes both namespaces (and with them the veth pair)."""
        self.close_processes()
        if self._up:
            for ns in self.namespaces:
                _run("ip", "netns", "del", ns, check=False)
            self._up = False

    def close_processes(self) -> None:
        """Kills the process groups this cluster started, then anything else still running in its namespaces."""
        for proc in self._procs:
            _kill_group(proc)
        self._procs.clear()
        if self._up:
            for ns in self.namespaces:
                _kill_namespace_processes(ns)

    # ------------------------------------------------------------------ link
    def shape(self, rate_mbit: float | None, delay_ms: float = 0.0) -> None:
        """Sets (or removes, with ``None``) the rate limit and delay on both ends of the veth."""
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms
        for ns, dev in zip(self.namespaces, self.interfaces, strict=True):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            parent = ["root"]
            if delay_ms:
                proc = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
                            "netem", "delay", f"{delay_ms}ms", "limit", "100000", check=False)  # fmt: skip
                if proc.returncode:
                    raise RuntimeError(
                        f"TwoNodeCluster: `delay_ms={delay_ms}` needs tc's netem qdisc, which this kernel refused"
                        f" ({proc.stderr.strip()}). Load sch_netem or use delay_ms=0."
                    )
                parent = ["parent", "1:"]
            if rate_mbit is not None:
                rate_bytes = rate_mbit * 1e6 / 8
                # burst: about 1 ms of traffic (at least 2 jumbo frames) so tbf holds the rate without starving TCP;
                # queue: 100 ms at the rate, enough that TCP never sees tail drops on a loss-free link.
                burst = max(32 * 1024, int(rate_bytes / 1000))
                limit = max(4 * burst, int(rate_bytes * 0.1))
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *parent, "tbf",
                     "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit))  # fmt: skip

    def counters(self, node: int) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) of node ``node``'s veth end, as its namespace sees them."""
        stats = Path("/sys/class/net") / self.interfaces[node] / "statistics"
        ns = self.namespaces[node]
        out = _run("ip", "netns", "exec", ns, "cat", str(stats / "tx_bytes"), str(stats / "rx_bytes"))
        tx, rx = out.stdout.split()
        return int(tx), int(rx)

    # ------------------------------------------------------------------ processes
    def popen(self, node: int, cmd: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        """Starts ``cmd`` inside node ``node``'s namespace, in a new process group (so its children die with it)."""
        if not self._up:
            raise RuntimeError("TwoNodeCluster.popen: the cluster is not up; use it inside `with TwoNodeCluster()`.")
        proc = subprocess.Popen(
            [shutil.which("ip") or "ip", "netns", "exec", self.namespaces[node], *cmd],
            env=env,
            start_new_session=True,
            **kwargs,
        )
        self._procs.append(proc)
        return proc


def _kill_group(proc: subprocess.Popen, grace: float = 3.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    try:  # the group may outlive its leader (Lightning's spawned local ranks)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def exit_on_signals() -> None:
    """Turns SIGTERM and SIGHUP into ``SystemExit`` so ``with TwoNodeCluster()`` cleans up (SIGINT already raises)."""

    def _raise(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)
