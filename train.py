"""Train one model under one parallelism strategy and log the run to MLflow.

    python train.py                                   # AlexNet on firesmall, one CPU core
    python train.py strategy=pipe model=vgg16 data=firesmall
    python train.py -m strategy=sequential,cpu_mp model=alexnet,vgg16   # a sweep: one run per job
"""
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ddlx.cli import hydra_job_tags, register_resolvers, report_config_errors

register_resolvers(Path(__file__).resolve().parent)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    from ddlx.run import train  # imported here so --help and config errors answer fast

    output_dir, tags = hydra_job_tags(cfg.paths.root)
    report_config_errors(lambda: train(cfg, output_dir, tags), in_sweep="sweep_id" in tags)


if __name__ == "__main__":
    main()
