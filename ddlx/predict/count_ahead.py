"""The job's model counted in a child process while recommend.py reads the measured runs.

A first question on a model pays its count (its profile and, for a GPU, its kernel trace: seconds
on deep networks, torchvision's import included) and, on every question, MLflow's import and the
store's read. The two do not depend on each other: a forked child counts while this process reads,
and the answer then finds the count in the profile cache on disk (:mod:`ddlx.costmodel.profile`).
The child only fills that cache: where it could not (a read-only home, an error), it says why in one
line on stderr, and the answer counts as it always did and reports what is wrong itself.
"""
from __future__ import annotations

import os
import sys

from ..costmodel.numerics import numerics_of
from ..job import Job
from ..process import forked
from .sequential_time import priced_per_layer


def count_ahead(job: Job, gpu: bool):
    """Start counting ``job``'s model (with its kernels at the job's precision where ``gpu``) in a
    forked child; the process to :func:`~ddlx.process.wait_for`, or None where there is no fork."""
    numerics = numerics_of(job.precision)
    kernels = gpu and priced_per_layer(numerics)  # as from_gpu_model reads them
    return forked(_count, (job.model, job.num_classes, job.channels, job.image_size, kernels, numerics.activation_bytes == 2),
                  "ddlx-count-ahead")


def _count(arch: str, num_classes: int, channels: int, image_size: int, kernels: bool, mixed: bool) -> None:
    try:
        import torch

        from ..costmodel.kernels import kernel_profile
        from ..costmodel.profile import profile_model

        torch.set_num_threads(1)  # as DataLoader's forked workers: the parent's OpenMP pool is not the child's
        profile_model(arch, num_classes, channels, image_size)
        if kernels:
            kernel_profile(arch, num_classes, channels, image_size, mixed)
    except KeyboardInterrupt:  # Ctrl-C reaches the parent too, which says so
        os._exit(1)
    except BaseException as error:  # noqa: BLE001 - the answer counts again; the line makes a child-only failure diagnosable
        said = " ".join(str(error).split())  # one line, as torch's errors are often several
        sys.stderr.write(f"ddlx: counting {arch} ahead in a child failed ({type(error).__name__}: {said}); "
                         f"the answer counts it itself\n")
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # no atexit handlers of the parent's (Hydra's, logging's) in the child
