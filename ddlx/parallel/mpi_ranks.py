"""MPI launch: ``mpirun`` starts every rank; Lightning's MPIEnvironment reads the ranks from mpi4py.

Each rank runs a local strategy on its own share of the machine (the Lerat et al. entry, section 2.6 and
its Figure 1: MPI between nodes, local parallelism inside each) and gradients are averaged
across all ranks by DDP over gloo (CPU) or NCCL (GPU).
"""
from __future__ import annotations

import os
import sys

from ..errors import ConfigError

INSTALL_HINT = (
    "install OpenMPI (apt-get install -y openmpi-bin libopenmpi-dev) and mpi4py (pip install -e '.[mpi]'), "
    "then start with: mpirun -np 2 python train.py strategy=mpi"
)


def mpi_layout() -> tuple[int, int, int]:
    """(world size, ranks on this node, nodes) of the running MPI job."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ConfigError(f"strategy=mpi needs mpi4py, which is not importable here ({err}); {INSTALL_HINT}") from err
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_size = node.Get_size()
    sizes = set(world.allgather(local_size))
    node.Free()
    if len(sizes) != 1:
        raise ConfigError(f"strategy=mpi needs the same number of ranks on every node, got {sorted(sizes)}; use mpirun --map-by ppr:N:node")
    return world.Get_size(), local_size, world.Get_size() // local_size


def _started_as_mpi_rank() -> bool:
    """One of several ranks that mpirun or srun (with PMI or PMIx) started."""
    size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or \
        (os.environ.get("SLURM_STEP_NUM_TASKS") if "PMIX_RANK" in os.environ else None)
    return int(size or 1) > 1


def set_rank_threads(local_size: int) -> int:
    """Intra-op threads of one MPI rank: its bound cores, or an equal share when mpirun did not bind."""
    import torch  # not at import: abort_job serves train.py's command-line check, before torch loads

    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // local_size) if cores == os.cpu_count() else cores
    torch.set_num_threads(threads)
    return threads


def abort_job(status: int, show_traceback: bool = True) -> None:
    """End the whole MPI job now, from a rank whose training failed (its run already marked
    FAILED) or that refused its job alone: mpi4py finalizes MPI at exit, which waits for every
    rank, and a lost rank never comes; the others would wait in their next collective, which has
    no timeout before the process group is up. MPI_Abort has mpirun or srun end them instead.
    Nothing outside an MPI job (of several ranks), where MPI_Abort would only add its banner."""
    if not _started_as_mpi_rank():
        return
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        # Refused before this rank joined MPI: join, to end the others (srun, unlike mpirun,
        # leaves them running when one task exits).
        try:
            from mpi4py import MPI as mpi
        except ImportError:
            return
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        if show_traceback:
            import traceback

            traceback.print_exc()  # what Hydra would have printed, had the process lived to
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(status)
