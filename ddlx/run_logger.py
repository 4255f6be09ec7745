"""The run's Lightning logger: Lightning's MLflow logger without its "failed": ddlx ends a failed
or stopped run itself, with what ended it (:func:`ddlx.tracking.recorded`)."""
from __future__ import annotations

from pytorch_lightning.loggers import MLFlowLogger


class RunLogger(MLFlowLogger):
    def finalize(self, status: str = "success") -> None:
        # Lightning says "failed" for any exception leaving fit, a stop signal's too, before its
        # teardown; ddlx ends the run after it with what ended it (KILLED and the signal, or FAILED
        # and the error). Killed in between (mpirun sends SIGKILL 1 s after its SIGTERM), the run
        # stays RUNNING, which the run's watch or the next look closes with how to resume, rather
        # than FAILED with no reason.
        if status != "failed":
            super().finalize(status)
