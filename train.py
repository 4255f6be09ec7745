"""Train one model under one parallelism strategy and log the run to MLflow.

    python train.py                                   # AlexNet on firesmall, one CPU core
    python train.py strategy=pipe model=vgg16 data=firesmall
    python train.py -m strategy=sequential,cpu_mp model=alexnet,vgg16   # a sweep: one run per job
    python train.py ckpt_path=outputs/DATE/TIME-ID/checkpoints/last.ckpt  # resume a run
"""
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ddlx.entry import (
    end_sweep,
    hydra_job_tags,
    note_sweep_job,
    register_config,
    resume_requeued_job,
    run_training_job,
)
from ddlx.command_line import task_overrides
from ddlx.config_check import check_command_line
from ddlx.parallel.rank_fork import start_fork_server
from ddlx.process import ended_by_ctrl_c, exit_without_collecting, job_takes_ctrl_c
from ddlx.rank_worker import main as rank_entry

PROJECT_DIR = Path(__file__).resolve().parent
register_config(PROJECT_DIR)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@job_takes_ctrl_c
def main(cfg: DictConfig) -> None:
    from ddlx.run import train  # imported here so --help and config errors answer fast
    from ddlx.strategies import starts_ranks

    start_fork_server(starts_ranks(cfg.strategy), rank_entry)  # extra ranks forked from this process as it is now, before it computes
    output_dir, tags = hydra_job_tags(cfg.paths.root)
    note_sweep_job(tags, cfg.logger)  # said at the sweep's end
    requeue = resume_requeued_job(cfg, tags)  # under SLURM: a requeued job resumes where it stopped
    run_training_job(lambda: train(cfg, output_dir, tags), in_sweep="sweep_id" in tags, overrides=task_overrides(),
                     requeue=requeue)


def check_and_run() -> None:
    check_command_line(sys.argv[1:], PROJECT_DIR / "conf", "train")  # every job, before Hydra starts one
    main()


if __name__ == "__main__":
    exit_without_collecting()
    try:
        # A run's own stop signals end it with its record and checkpoint (ddlx.stopping); Ctrl-C
        # outside one (imports, the data's first writing, a finished run's last lines) ends here; one
        # inside omegaconf composing a config, at the next point where it cannot break the config.
        stopped = ended_by_ctrl_c("train.py", check_and_run,
                                  "no run was open (a run's Ctrl-C writes its checkpoint and says so)",
                                  hold_in_omegaconf=True)
        if stopped:
            raise SystemExit(stopped)
    except BaseException:  # a job that failed (Hydra exits 1 after the last job), a stop signal, Ctrl-C
        end_sweep(failed=True)  # what the runs came to; the failure's own exit status stands
        raise
    end_sweep()  # a sweep ends with what its runs came to; one whose jobs were refused, with status 1
