"""Export a store's finished runs and the machine they were measured on (hw=local as recommend.py
detects it: its cores, memory and timed rates) into one JSON file: the fixture of real runs that
tests/test_validation.py predicts.

    python studies/cpu-2core/export_fixture.py [--tracking-uri URI] [--detected-dir DIR] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlflow.db'}")
    parser.add_argument("--detected-dir", type=Path, default=ROOT / "outputs" / "hw",
                        help="where recommend.py kept this machine's timed rates (its detected_dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "cpu2core_runs.json")
    args = parser.parse_args()

    from ddlx.predict.cli import hardware, load_hw_file
    from ddlx.records import export_run, usable
    from ddlx.tracking import load_runs

    runs = [r for r in load_runs(args.tracking_uri, ["ddlx"]) if usable(r)]
    hw = hardware(load_hw_file(ROOT / "conf" / "hw" / "local.yaml"), args.detected_dir)
    doc = {"hardware": dataclasses.asdict(hw) | {"detect": False},
           "runs": [export_run(r) for r in sorted(runs, key=lambda r: r.run_id)]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(runs)} runs measured on {hw.host} to {args.out}")


if __name__ == "__main__":
    main()
