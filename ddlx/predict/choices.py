"""recommend.py's ``strategies`` and ``candidates`` options, checked without torch: by its
command line's check (before Hydra makes the job's folder) and by the job."""
from __future__ import annotations

from ..config_check import did_you_mean
from ..errors import ConfigError
from ..job import Batches
from ..strategies import STRATEGIES


def check_strategies(names) -> list[str]:
    """recommend.py's ``strategies`` option, checked: names of strategies ([]: every one)."""
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ConfigError(f"strategies=[{','.join(names)}]: {unknown[0]} is not a strategy"
                          f"{did_you_mean(unknown[0], list(STRATEGIES))}; the strategies are {', '.join(STRATEGIES)}, "
                          f"e.g. strategies=[ddp_nccl,pipe]")
    return list(names)


def check_tries(candidates: dict) -> tuple[dict, Batches]:
    """recommend.py's ``candidates`` option, checked: the knob values each strategy's candidates
    try (lists, each value within the knob's declared range) and the batches given to strategies
    of their own (``batch_size``). A knob tried is one that names a setup (its models read it).
    Every error names the key."""
    tries, own = {}, []
    for name, knobs in (candidates or {}).items():
        if name not in STRATEGIES:
            raise ConfigError(f"candidates.{name}: no strategy of that name; the strategies are {', '.join(STRATEGIES)}")
        declared = STRATEGIES[name].setup_fields()
        chosen = {}
        for knob, values in (knobs or {}).items():
            key = f"candidates.{name}.{knob}"
            if values is None:
                continue  # the strategy's own choice
            if knob == "batch_size":
                if not isinstance(values, int) or isinstance(values, bool) or values < 1:
                    raise ConfigError(f"{key}={values}; expected one batch size >= 1 (in data.batch_per's terms), "
                                      f"e.g. {key}=48")
                own.append((name, values))
                continue
            if knob not in declared:
                raise ConfigError(f"{key}: {knob!r} is not a knob the recommender tries for {name} (one its models read); "
                                  f"those are {', '.join(declared)} (and batch_size)")
            values = list(values) if isinstance(values, (list, tuple)) else [values]
            bound = declared[knob].metadata.get("bound")
            bad = [v for v in values if bound is not None and not bound.accepts(v)]
            if not values or bad:
                raise ConfigError(f"{key}={values}; expected a list of values, each {bound.expected() if bound else 'a value'}"
                                  f", e.g. {key}=[{declared[knob].default}]")
            chosen[knob] = values
        tries[name] = chosen
    return tries, own
