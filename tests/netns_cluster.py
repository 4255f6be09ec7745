"""Several "hosts" on one machine: Linux network namespaces, each a node with its own host name
and address on a virtual switch, for running ddlx across nodes as a user runs it across machines.

The switch is a bridge inside a namespace of its own; each node's ``eth0`` is one end of a veth
pair whose other end is plugged into the bridge. Nothing is added to the machine's own network
namespace, and the only addresses are the nodes' (``10.77.<net>.<i+1>/24``). Each node has a
hosts file naming every node (``ip netns exec`` mounts ``/etc/netns/<node>/hosts`` over
``/etc/hosts`` inside the namespace), and commands run there under a UTS namespace with the node's
host name, so ``socket.gethostname()`` and its address are the node's, as on a real machine.

Open MPI starts the remote ranks through :data:`AGENT` (its ``plm_rsh_agent``, in place of
ssh): ``AGENT <host> <command>`` runs the command inside that host's namespace.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

AGENT = Path(__file__).with_name("netns_agent.sh")


def unavailable() -> str | None:
    """Why this machine cannot make the namespaces (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y iproute2 util-linux)"
    probe = f"ddlx-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


class Cluster:
    """``nodes`` namespaces on one virtual switch; a context manager that removes them all."""

    def __init__(self, nodes: int, net: int = 77) -> None:
        tag = uuid.uuid4().hex[:4]
        self.hosts = [f"ddlx{tag}n{i}" for i in range(nodes)]
        self.switch = f"ddlx{tag}sw"
        self.addresses = [f"10.77.{net}.{i + 1}" for i in range(nodes)]

    def __enter__(self) -> Cluster:
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            _ip("link", "set", "br0", "up", netns=self.switch)
            for i, (host, address) in enumerate(zip(self.hosts, self.addresses)):
                _ip("netns", "add", host)
                _ip("link", "add", f"p{i}", "netns", self.switch, "type", "veth", "peer", "name", "eth0", "netns", host,
                    netns=self.switch)
                _ip("link", "set", f"p{i}", "master", "br0", "up", netns=self.switch)
                _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=host)
                _ip("link", "set", "eth0", "up", netns=host)
                _ip("link", "set", "lo", "up", netns=host)
                etc = Path("/etc/netns") / host
                etc.mkdir(parents=True, exist_ok=True)
                names = "".join(f"{a} {h}\n" for a, h in zip(self.addresses, self.hosts))
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for host in self.hosts:
            self.kill(host)
            subprocess.run(["ip", "netns", "delete", host], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / host, ignore_errors=True)
        subprocess.run(["ip", "netns", "delete", self.switch], capture_output=True)

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` as run on ``host`` (its namespace, host name and hosts file)."""
        return [str(AGENT), host, " ".join(_quote(a) for a in argv)]

    def hostfile(self, path: Path, slots: int) -> Path:
        path.write_text("".join(f"{host} slots={slots}\n" for host in self.hosts))
        return path

    def pids(self, host: str, only: str | None = None) -> list[int]:
        """The processes of ``host``, or those whose command line starts with ``only``."""
        out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout
        return [int(p) for p in out.split() if only is None or _cmdline(int(p)).startswith(only)]

    def unplug(self, host: str) -> None:
        """Its cable pulled: nothing reaches ``host`` or leaves it (no reset either, as when a machine dies)."""
        _ip("link", "set", f"p{self.hosts.index(host)}", "down", netns=self.switch)

    def plug(self, host: str) -> None:
        _ip("link", "set", f"p{self.hosts.index(host)}", "up", netns=self.switch)

    def kill(self, host: str, only: str | None = None) -> list[int]:
        """SIGKILL every process of ``host`` (the machine died), or those whose command line starts with ``only``."""
        pids = self.pids(host, only)
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
    except OSError:  # ended meanwhile
        return ""


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def mpirun(cluster: Cluster, ranks: int, per_node: int, hostfile: Path) -> list[str]:
    """``mpirun`` across the cluster's hosts as a user starts it across machines: a host file,
    the remote agent in place of ssh, and TCP only over the nodes' ``eth0``."""
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), "--hostfile", str(hostfile),
            "--map-by", f"ppr:{per_node}:node", "--mca", "plm_rsh_agent", str(AGENT),
            "--mca", "oob_tcp_if_include", "eth0", "--mca", "btl_tcp_if_include", "eth0", "--mca", "btl", "self,tcp"]
