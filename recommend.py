"""Predict seconds per epoch and memory for every strategy on a described machine; recommend one.

    python recommend.py hw=titanrtx_4x model=vgg16 data=firesmall     # ranked table + recommendation
    python recommend.py hw=local output=json                         # this machine, as JSON
    python recommend.py mode=validate                                # leave-one-out on the measured runs
    python recommend.py mode=probe                                   # measure this machine's links
"""
import functools
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ddlx.entry import register_recommend_config, report_config_errors
from ddlx.config_check import check_command_line, check_recommend_job
from ddlx.process import ended_by_ctrl_c, exit_without_collecting, job_takes_ctrl_c

ROOT = Path(__file__).resolve().parent
register_recommend_config(ROOT)


@hydra.main(version_base="1.3", config_path="conf", config_name="recommend")
@job_takes_ctrl_c
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from ddlx.predict.cli import run

    hydra_cfg = HydraConfig.get()
    # The user's model/data/allocator/precision overrides, so the train.py command it prints trains the same job.
    keys = {o: o.lstrip("+~").split("=")[0] for o in hydra_cfg.overrides.task}
    job_overrides = [o for o, key in keys.items() if key.split(".")[0] in ("model", "data", "cpu_allocator", "trainer")]
    hw_overrides = [o for o, key in keys.items() if key.startswith("hw.")]  # hw=X's fields changed: another machine
    # Where the runs it reads are: the printed commands record theirs there, so the next answer counts them.
    store_overrides = [o for o, key in keys.items() if key.startswith("paths.") or key == "logger.tracking_uri"]
    if any(key == "experiments" for key in keys.values()) and len(cfg.experiments) == 1:
        store_overrides.append(f"logger.experiment_name={cfg.experiments[0]}")
    report_config_errors(lambda: run(cfg, Path(hydra_cfg.runtime.output_dir), ROOT / "conf" / "hw", job_overrides,
                                     hw_overrides, store_overrides))


def check_and_run() -> None:
    hw_options = functools.partial(check_recommend_job, hw_dir=ROOT / "conf" / "hw")
    check_command_line(sys.argv[1:], ROOT / "conf", "recommend", hw_options)  # before Hydra starts the job
    main()


if __name__ == "__main__":
    exit_without_collecting()
    raise SystemExit(ended_by_ctrl_c("recommend.py", check_and_run, hold_in_omegaconf=True))
