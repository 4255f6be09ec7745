"""A SLURM cluster on one machine, for running ddlx as a cluster user does: ``sbatch``, ``srun``,
``scancel --signal``, requeue, and Hydra's submitit launcher.

One controller (``slurmctld``) and one node daemon (``slurmd``) for this machine, or, over the
network namespaces of tests/netns_cluster.py, a node daemon in each namespace "host" and the
controller on the first; with their own munge daemon, key, ports, state and logs inside one
folder: nothing of the machine's own set-up (``/etc/slurm``, ``/etc/munge``, a running munged)
is read or changed. Clients find the cluster through ``SLURM_CONF`` (:meth:`LocalSlurm.env`);
jobs inherit it, so a job's own ``scontrol`` talks to this cluster too. (munge's socket is a
file: daemons in every namespace reach it.)
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sacct")


def unavailable() -> str | None:
    """Why this machine cannot run the local cluster (None: it can)."""
    if os.geteuid() != 0:
        return "the local SLURM cluster runs its daemons as root"
    missing = [tool for tool in TOOLS if not Path(_tool(tool)).exists()]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing: apt-get install -y slurm-wlm munge)"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurm:
    """The cluster in ``folder``; a context manager that stops its daemons."""

    def __init__(self, folder: Path, cpus: int | None = None, hosts=None) -> None:
        """``hosts``: a :class:`netns_cluster.Cluster` whose hosts are the nodes (None: this machine)."""
        self.folder = Path(folder)
        self.hosts = hosts
        self.nodes = list(hosts.hosts) if hosts is not None else [socket.gethostname()]
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.folder / "slurm.conf"
        self._daemons: list[subprocess.Popen] = []

    def on(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` as run on ``node``."""
        return self.hosts.command(node, argv) if self.hosts is not None else argv

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (or this process's environment) pointed at this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def __enter__(self) -> LocalSlurm:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        f = self.folder
        for sub in ("state", "log", "munge", *(f"spool/{n}" for n in self.nodes)):
            (f / sub).mkdir(parents=True, exist_ok=True)
        # slurmd loads its cgroup plugin whatever the proctrack and task plugins; a namespace host's
        # /sys (ip netns exec mounts a fresh one) has no cgroup mounts: slurmd makes them.
        (f / "cgroup.conf").write_text("CgroupAutomount=yes\n")
        # PMIx's per-step folders, named by job and step only: each node needs its own (below).
        (f / "pmix").mkdir(exist_ok=True)
        (f / "mpi.conf").write_text(f"PMIxCliTmpDirBase={f / 'pmix'}\n")
        key, munge_socket = f / "munge" / "munge.key", f / "munge" / "munge.socket"
        subprocess.run([_tool("mungekey"), "--create", "--force", f"--keyfile={key}"], check=True, capture_output=True)
        key.chmod(0o600)
        self._daemons.append(subprocess.Popen(
            [_tool("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={munge_socket}",
             f"--pid-file={f / 'munge' / 'munged.pid'}", f"--log-file={f / 'log' / 'munged.log'}",
             f"--seed-file={f / 'munge' / 'seed'}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        wait_until(lambda: munge_socket.exists(), 10, "munged did not open its socket", f / "log" / "munged.log")
        ctld_port, node_port = _free_ports(2)
        addresses = self.hosts.addresses if self.hosts is not None else [None] * len(self.nodes)
        controller = self.nodes[0] + (f"({addresses[0]})" if addresses[0] else "")
        nodes = "".join(f"NodeName={n}{f' NodeAddr={a}' if a else ''} CPUs={self.cpus} RealMemory=4000 State=UNKNOWN\n"
                        for n, a in zip(self.nodes, addresses))
        # cred_expire: how long a requeued job waits before it may start again (120 s by default);
        # sched_interval and bf_interval: how often pending jobs are looked at (60 s and 30 s).
        self.conf.write_text(f"""\
ClusterName=ddlx
SlurmctldHost={controller}
SlurmctldPort={ctld_port}
SlurmdPort={node_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=5
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
StateSaveLocation={f / 'state'}
SlurmdSpoolDir={f / 'spool' / '%n'}
SlurmctldPidFile={f / 'slurmctld.pid'}
SlurmdPidFile={f / 'slurmd-%n.pid'}
SlurmctldLogFile={f / 'log' / 'slurmctld.log'}
SlurmdLogFile={f / 'log' / 'slurmd-%n.log'}
{nodes}PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        env = self.env()
        daemons = [self.on(self.nodes[0], [_tool("slurmctld"), "-D", "-i", "-f", str(self.conf)])]
        slurmd = [[_tool("slurmd"), "-D", "-N", n, "-f", str(self.conf)] for n in self.nodes]
        if self.hosts is not None:  # in each host's own mount namespace (ip netns exec makes one)
            mounts = ["mount -t tmpfs cgroup /sys/fs/cgroup", "mkdir /sys/fs/cgroup/systemd",
                      "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd",
                      f"mount -t tmpfs pmix {f / 'pmix'}"]  # the host's own, as on separate machines
            slurmd = [["sh", "-c", " && ".join([*mounts, f"exec {' '.join(argv)}"])] for argv in slurmd]
        daemons += [self.on(n, argv) for n, argv in zip(self.nodes, slurmd)]
        for argv in daemons:
            self._daemons.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        wait_until(self._nodes_idle, 30, "the nodes did not come up", f / "log" / "slurmctld.log")

    def _nodes_idle(self) -> bool:
        for daemon in self._daemons:
            if daemon.poll() is not None:
                raise RuntimeError(f"{' '.join(daemon.args)} exited with {daemon.returncode}: see {self.folder / 'log'}")
        states = self.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.split()
        return len(states) == len(self.nodes) and all(s == "idle" for s in states)

    def run(self, *argv: str, check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster, run on its first node."""
        kwargs.setdefault("env", self.env())
        proc = subprocess.run(self.on(self.nodes[0], list(argv)), capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def job_state(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode...); {} once it is forgotten."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if proc.returncode:
            return {}
        return dict(field.split("=", 1) for field in proc.stdout.split() if "=" in field)

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """Wait until the job is in one of ``states``; returns its fields."""
        fields: dict[str, str] = {}

        def reached() -> bool:
            nonlocal fields
            fields = self.job_state(job_id)
            return fields.get("JobState") in states

        wait_until(reached, timeout, f"job {job_id} did not reach {states} (last: {fields.get('JobState')})",
              self.folder / "log" / "slurmctld.log")
        return fields

    def __exit__(self, *exc) -> None:
        if self._daemons and self.conf.exists():
            self.run("scancel", "--full", "--user=root", check=False)
            try:
                wait_until(lambda: not self.run("squeue", "--noheader", check=False).stdout.strip(), 15, "jobs ending")
            except TimeoutError:
                pass  # what is left is killed below
        for daemon in reversed(self._daemons):
            daemon.terminate()
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=3)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """Job step daemons (``slurmstepd``) and job processes outlive slurmd; they carry this
        cluster's ``SLURM_CONF``, which nothing else does."""
        mark = f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if mark in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), 9)
            except (OSError, ProcessLookupError):
                pass


def wait_until(ready, timeout: float, what: str, log: Path | None = None) -> None:
    """Poll ``ready`` until true; a TimeoutError naming ``what`` (and the tail of ``log``) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            tail = "".join(log.read_text().splitlines(True)[-15:]) if log is not None and log.exists() else ""
            raise TimeoutError(f"{what} within {timeout:.0f} s" + (f"; {log}:\n{tail}" if tail else ""))
        time.sleep(0.3)
