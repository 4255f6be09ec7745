"""The run's Lightning logger: Lightning's MLflow logger without its "failed": ddlx ends a failed
or stopped run itself, with what ended it (:func:`ddlx.tracking.recorded`)."""
from __future__ import annotations

from pytorch_lightning.loggers import MLFlowLogger


class RunLogger(MLFlowLogger):
    def finalize(self, status: str = "success") -> None:
        # Lightning says "failed" for any exception leaving fit, a stop signal's too, before its
        # teardown. ddlx ends the run itself with what ended it: a stop as it leaves training
        # (ddlx.stopping.RecordStop: KILLED, the signal), an error after the teardown (FAILED, the
        # error). A process killed before that (mpirun sends SIGKILL 1 s after its SIGTERM) leaves
        # the run RUNNING, which its watch or the next look closes with how to resume, rather than
        # FAILED with no reason.
        if status != "failed":
            super().finalize(status)
