"""Train one model under one parallelism strategy and log the run to MLflow.

    python train.py                                   # AlexNet on firesmall, one CPU core
    python train.py strategy=pipe model=vgg16 data=firesmall
    python train.py -m model=alexnet,vgg16 data=firesmall
"""
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ddlx.cli import register_resolvers, report_config_errors

register_resolvers(Path(__file__).resolve().parent)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    from ddlx.run import train  # imported here so --help and config errors answer fast

    output_dir = HydraConfig.get().runtime.output_dir
    report_config_errors(lambda: train(cfg, output_dir))


if __name__ == "__main__":
    main()
