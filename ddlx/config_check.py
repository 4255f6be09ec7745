"""Check a composed config against the schema (:mod:`ddlx.config`) and say what is wrong in the
user's terms: the key, what it expects, and the override that fixes it (a did-you-mean for a
misspelled key). Hydra's and OmegaConf's own errors are translated the same way. No torch here.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import sys
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_origin, get_type_hints

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    InterpolationValidationError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from .config import (
    STRATEGY_CONFIGS,
    TRAINER_ARGS_SET_BY_DDLX,
    OptimConfig,
    RecommendConfig,
    RecommendTrainerConfig,
    TrainConfig,
    TrainerConfig,
)
from .errors import ConfigError
from .process import raise_held_ctrl_c

TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}

# train.py and recommend.py compose from one conf/ folder, so each one's --help lists the other's
# groups too. A group or key of the other, given to one, is said so, with what this one takes instead.
ENTRIES = {"train": ("train.py", TrainConfig), "recommend": ("recommend.py", RecommendConfig)}
INSTEAD = {
    ("train", "hw"): "train.py trains on this machine; the machine recommend.py predicts for is its hw "
                     "(python recommend.py hw=NAME model=... data=...)",
    ("recommend", "strategy"): "recommend.py ranks every strategy on its hw, or those of strategies=[...] (e.g. "
                               "strategies=[ddp_nccl,pipe]); candidates.STRATEGY.KNOB=[...] sets the knob values it "
                               "tries (e.g. candidates.pipe.chunks=[4,8])",
    ("recommend", "trainer"): "recommend.py's device kind comes from hw=, and its trainer keys are trainer.precision "
                              "and trainer.max_epochs",
    ("recommend", "experiment"): "recommend.py takes the job as model=, data= and their keys",
}


def other_entry_problem(key: str, here: str) -> str | None:
    """``key`` (a group, or a dotted key) given to entry point ``here`` ('train' or 'recommend')
    that is the other one's: what that is and what ``here`` takes instead (None: not the other's)."""
    top, _, leaf = key.lstrip("+~").partition(".")
    other = "recommend" if here == "train" else "train"
    (this_script, this_schema), (other_script, other_schema) = ENTRIES[here], ENTRIES[other]
    groups = {"train": {"hw"}, "recommend": {"strategy", "experiment"}}[here]  # the other's, beyond its schema's keys
    theirs = groups | ({f.name for f in fields(other_schema)} - {f.name for f in fields(this_schema)})
    if here == "recommend" and top == "trainer":  # the trainer group, or a trainer key recommend.py does not take
        ours = {f.name for f in fields(RecommendTrainerConfig)}
        theirs |= {"trainer"} if not leaf or (leaf in {f.name for f in fields(TrainerConfig)} and leaf not in ours) else set()
    if top not in theirs:
        return None
    said = key.lstrip("+~")
    instead = INSTEAD.get((here, top), f"{this_script}'s keys are in its --help")
    return f"{said} is {other_script}'s, not {this_script}'s: {instead}"


def check_config(cfg: DictConfig) -> DictConfig:
    """The train config merged into its schema (types, keys), every bound checked; else a
    :class:`ConfigError`. Returns the typed config."""
    try:
        # Through a plain container: a typed node merged as is keeps the keys added with '+'.
        typed = OmegaConf.merge(schema_for(cfg), OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)))
    except OmegaConfBaseException as err:
        raise explain(err) from None
    check_bounds(typed)
    return typed


def typed_config(cfg: DictConfig):
    """The train config, checked (:func:`check_config`), as the dataclasses of :mod:`ddlx.config`
    (``strategy``: its spec's config): what the code below the entry points reads."""
    typed = check_config(cfg)
    try:
        return OmegaConf.to_object(typed)
    except OmegaConfBaseException as err:  # an interpolation that does not resolve
        raise explain(err) from None


def option_params(option: str) -> dict[str, str] | None:
    """The params (flattened as a run's) of train.py's config given only ``option`` (``data=firesmall``):
    its group's values as that option sets them. None where it cannot be composed (the option is
    gone, no config folder): the caller then names every value itself."""
    from dataclasses import asdict

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from .tracking import flatten_config

    def params() -> dict[str, str]:
        return flatten_config(asdict(typed_config(compose(config_name="train", overrides=[option]))))

    try:
        if GlobalHydra.instance().is_initialized():  # in train.py's job: the config folder it composed from
            return params()
        conf = Path(OmegaConf.create({"project": "${project_dir:}"}).project) / "conf"
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return params()
    except Exception:  # noqa: BLE001 - (another launcher's process, a moved folder): the caller's longer words stand
        return None


def typed_recommend_config(cfg: DictConfig):
    """recommend.py's config but ``hw`` as a :class:`~ddlx.config.RecommendConfig`; a key it does
    not have, a value of the wrong type or out of its range is a :class:`ConfigError` naming it."""
    from .config import RecommendConfig

    try:
        given = OmegaConf.to_container(cfg, resolve=True)
        given.pop("hw", None)
        typed = OmegaConf.merge(OmegaConf.structured(RecommendConfig), given)
    except InterpolationValidationError as err:  # a typed group's copy of a key (data.seed is ${seed}): named as given
        source = _copied_key(cfg, err.full_key)
        if source is not None:
            err.full_key, err.object_type = source, RecommendConfig if "." not in source else None
        raise explain(err) from None
    except OmegaConfBaseException as err:
        raise explain(err) from None
    check_bounds(typed, cfg)  # its own keys' ranges (seed, probe_max_s) and the model and data groups'
    try:
        return OmegaConf.to_object(typed)
    except OmegaConfBaseException as err:
        raise explain(err) from None


def _copied_key(cfg: DictConfig, full_key: str) -> str | None:
    """The key whose value ``full_key`` copies (``${seed}``: seed), or None."""
    parent, _, leaf = full_key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    raw = node._get_node(leaf)._value() if isinstance(node, DictConfig) and leaf in node else None
    found = re.fullmatch(r"\$\{([\w.]+)\}", raw) if isinstance(raw, str) else None
    return found.group(1) if found else None


def check_bounds(cfg: DictConfig, composed: DictConfig | None = None) -> None:
    """Every value of a typed node (one whose schema is a dataclass of :mod:`ddlx.config`) within
    its declared range or choices, and none missing; else a :class:`ConfigError` naming them all.
    ``composed``: the config as composed, its interpolations kept, where ``cfg`` was made from
    resolved values."""
    try:
        values = _resolved(cfg)
    except OmegaConfBaseException as err:
        raise explain(err) from None
    problems = dict(_bound_problems(cfg, values, ""))
    # A key that copies another (data.seed is ${seed}) is out of range with it: said once, at the one given.
    said = [problem for key, problem in problems.items() if _copied_key(composed or cfg, key) not in problems]
    if said:
        raise ConfigError("; ".join(said))


def _resolved(node: DictConfig) -> dict:
    """The node's values, resolved; a value taken from Hydra's own config (``${hydra:...}``),
    which exists only once Hydra runs the job, is left out (None)."""
    values: dict = {}
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            values[key] = _resolved(child)
            continue
        try:
            value = node[key]
        except InterpolationResolutionError:
            if "${hydra:" in str(child._value()):
                values[key] = None
                continue
            raise
        values[key] = OmegaConf.to_container(value, resolve=True) if isinstance(value, ListConfig) else value
    return values


def schema_for(cfg: DictConfig) -> DictConfig:
    """The train schema, its ``strategy`` typed as the strategy that ``cfg`` names."""
    name = OmegaConf.select(cfg, "strategy.name", default=None)
    if name not in STRATEGY_CONFIGS:
        raise ConfigError(
            f"strategy={name} is not a strategy ddlx knows{did_you_mean(str(name), STRATEGY_CONFIGS)}; "
            f"expected one of {', '.join(STRATEGY_CONFIGS)}"
        )
    schema = OmegaConf.structured(TrainConfig)
    schema.strategy = OmegaConf.structured(STRATEGY_CONFIGS[name])
    return schema


def _bound_problems(node: DictConfig, values: dict, prefix: str) -> Iterator[tuple[str, str]]:
    """(key, what is wrong) for each value of ``node`` out of its range."""
    object_type = OmegaConf.get_type(node)
    bounds = {f.name: (f, f.metadata["bound"]) for f in fields(object_type) if "bound" in f.metadata} \
        if is_dataclass(object_type) else {}
    for key, value in values.items():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and isinstance(value, dict):
            yield from _bound_problems(child, value, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):  # passes every range: NaN compares False
            yield (f"{prefix}{key}",
                   f"{prefix}{key}={_show(value)}: expected a finite number{_example(bounds[key][0], prefix) if key in bounds else ''}")
        elif key in bounds and not bounds[key][1].accepts(value):
            yield f"{prefix}{key}", f"{prefix}{key}={_show(value)}: expected {bounds[key][1].expected()}{_example(bounds[key][0], prefix)}"


def _example(f, prefix: str) -> str:
    default = f.default
    if default is None or isinstance(default, (list, dict)) or str(default) == "???" or default is f.default_factory:
        return ""
    if not isinstance(default, (int, float, str, bool)):
        return ""
    return f", e.g. {prefix}{f.name}={_show(default)}"


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


# ---- translating OmegaConf and Hydra errors ---------------------------------------------------


def explain(err: BaseException, override: str | None = None) -> ConfigError:
    """A :class:`ConfigError` for an error raised while composing or typing the config."""
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and getattr(err, "full_key", None):
        return ConfigError(_unknown_key(err.full_key, getattr(err, "object_type", None)))
    if isinstance(err, ValidationError) and getattr(err, "full_key", None):
        return ConfigError(_wrong_type(err))
    if isinstance(err, MissingMandatoryValue) and getattr(err, "full_key", None):
        return ConfigError(f"{err.full_key} has no value; set it ({err.full_key}=...)")
    if isinstance(err, InterpolationResolutionError):
        return ConfigError(f"{getattr(err, 'full_key', '') or 'a value'} cannot be resolved: {_first_line(err)}")
    where = f" in override {override!r}" if override else ""
    return ConfigError(f"{_first_line(err)}{where}")


def _unknown_key(full_key: str, object_type: Any) -> str:
    parent, _, leaf = full_key.rpartition(".")
    if parent == "trainer" and leaf in TRAINER_ARGS_SET_BY_DDLX:
        return f"trainer.{leaf} is set by ddlx: {TRAINER_ARGS_SET_BY_DDLX[leaf]}"
    if object_type is dict and parent in set(_free_mappings(TrainConfig, "")):  # logger.tags: '+' adds entries
        return f"{full_key} is not in {parent} yet; add it with +{full_key}=VALUE"
    known = [f.name for f in fields(object_type)] if is_dataclass(object_type) else []
    where = f"{parent}" if parent else "the config"
    if parent == "strategy":
        strategy = next((n for n, config in STRATEGY_CONFIGS.items() if config is object_type), None)
        elsewhere = [n for n, config in STRATEGY_CONFIGS.items() if leaf in {f.name for f in fields(config)}]
        also = f"; {leaf} is a knob of strategy={'|'.join(elsewhere)}" if elsewhere else ""
        return (f"strategy.{leaf} is not a knob of strategy={strategy}{_key_hint(leaf, known, 'strategy.')} "
                f"(its knobs: {', '.join(k for k in known if k != 'name')}){also}")
    # A close spelling here, else the same name under another parent (trainer.mode: compile.mode), else a family.
    here = f"{parent}." if parent else ""
    hint = _hint(_closest(leaf, known), here) or _elsewhere(leaf, full_key) or _hint(_family(leaf, known), here)
    listing = f" (its keys: {', '.join(known)})" if known else ""  # an untyped node: its keys are not known here
    return f"{full_key} is not a key of {where}{hint}{listing}"


def _elsewhere(leaf: str, full_key: str) -> str:
    """A key given under the wrong parent (``data.lr``): where a key of that name lives."""
    found = [path for path in _schema_keys(TrainConfig, "") if path.rpartition(".")[2] == leaf and path != full_key]
    return f"; did you mean {' or '.join(found)}?" if found else ""


def _schema_keys(object_type: Any, prefix: str) -> Iterator[str]:
    for f in fields(object_type):
        nested = f.type if is_dataclass(f.type) else _dataclass_of(f)
        if nested is not None:
            yield from _schema_keys(nested, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _free_mappings(object_type: Any, prefix: str) -> Iterator[str]:
    """The schema's fields typed as mappings of any keys (``logger.tags``), by dotted name."""
    for name, hint in get_type_hints(object_type).items():
        if get_origin(hint) is dict:
            yield f"{prefix}{name}"
        elif is_dataclass(hint):
            yield from _free_mappings(hint, f"{prefix}{name}.")


def _dataclass_of(f) -> Any:
    default = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
    if is_dataclass(default):
        return type(default)
    return {"trainer": TrainerConfig, "optim": OptimConfig}.get(f.name)  # MISSING groups: their options' schema


def _wrong_type(err: ValidationError) -> str:
    key, value = err.full_key, _offending_value(err)
    expected, example = _expected_type(err)
    if value is None:
        return f"{key}: expected {expected} ({_first_line(err)})"
    return f"{key}={value}: expected {expected}{example}"


def _offending_value(err: ValidationError) -> str | None:
    text = str(err)
    if text.startswith("Value '"):
        return text[len("Value '"):].split("'", 1)[0]
    value = getattr(err, "value", None)  # a dict's entry (logger.tags.x=[1,2]): the value itself
    return None if value is None else _show(value).replace(" ", "")


def _expected_type(err: ValidationError) -> tuple[str, str]:
    """What the key's type asks for, and an example (its default) when there is one."""
    object_type = getattr(err, "object_type", None)
    prefix, _, leaf = err.full_key.rpartition(".")
    if is_dataclass(object_type):
        for f in fields(object_type):
            if f.name == leaf:
                return _type_words(f.type), _example(f, f"{prefix}." if prefix else "")
    ref_type = getattr(err, "ref_type", None)
    if typing.get_origin(ref_type) is typing.Union:  # Optional[List[float]]: the list's
        ref_type = next((t for t in typing.get_args(ref_type) if t is not type(None)), None)
    if typing.get_origin(ref_type) in (dict, list):  # an entry of a typed dict (logger.tags.x) or list (data.std[0])
        entry = typing.get_args(ref_type)[-1]
        return _type_words(entry.__name__ if isinstance(entry, type) else entry), ""
    return _first_line(err), ""


def _type_words(annotation: Any) -> str:
    text = str(annotation)
    optional = text.startswith("Optional[")
    inner = text[len("Optional["):-1] if optional else text
    words = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "List[str]": "a list of strings, e.g. [a,b]", "List[int]": "a list of integers, e.g. [1,2]",
             "List[float]": "a list of numbers, e.g. [0.5,0.5]", "Dict[str, str]": "a mapping of strings"}
    word = words.get(inner, inner)
    return f"{word} or null" if optional else word


def did_you_mean(word: str, candidates: Sequence[str], prefix: str = "") -> str:
    """A group option's hint: its family (:func:`_family`), failing that its closest spelling."""
    return _hint(_family(word, candidates) or _closest(word, candidates), prefix)


def _key_hint(word: str, candidates: Sequence[str], prefix: str) -> str:
    """A key's hint: its closest spelling, failing that its family."""
    return _hint(_closest(word, candidates) or _family(word, candidates), prefix)


def _family(word: str, candidates: Sequence[str]) -> list[str]:
    """Those that ``word`` begins or whose ``_``-parts include all of its own: a family named
    without its member (``ddp`` is ddp_gloo or ddp_nccl, ``resnet`` its three depths, ``a100_8x``
    both 8-GPU A100s). None for words too short to name one, or where it would list most."""
    if len(word) < 3:
        return []
    parts = set(word.split("_"))
    members = [c for c in candidates if c.startswith(word) or parts <= set(c.split("_"))]
    return members if len(members) <= 4 else []


def _closest(word: str, candidates: Sequence[str]) -> list[str]:
    """The closest spellings of ``word`` (difflib's ratio, at least 0.6): every one tied for the
    closest (``resnet34``: resnet18 or resnet50), not the one of them whose name sorts last; none
    where more than four tie (as :func:`_family`)."""
    scores = {c: difflib.SequenceMatcher(None, c, word).ratio() for c in candidates}  # as get_close_matches scores
    best = max((score for score in scores.values() if score >= 0.6), default=None)
    tied = [c for c, score in scores.items() if score == best]
    return tied if len(tied) <= 4 else []


def _hint(names: Sequence[str], prefix: str) -> str:
    return f"; did you mean {' or '.join(prefix + name for name in names)}?" if names else ""


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


# ---- the command line, before Hydra runs it ---------------------------------------------------


def check_command_line(argv: Sequence[str], config_dir: Path, config_name: str, check=None) -> None:
    """Compose every job the command line asks for (each job of a ``-m`` sweep) and check it
    (``check(cfg, multirun)``, default :func:`check_train_job`: train.py's), so a bad value is reported
    in about a second, before Hydra starts any job; print the errors and exit with status 2.
    Hydra's own flags (--help, --cfg, ...) are left to Hydra, but those it would answer with a
    traceback (:func:`_flag_errors`)."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(list(argv))
    _STORES_CHECKED.clear()
    if args.help or args.hydra_help:
        return  # Hydra answers these first, whatever else is given
    if flag_errors := _flag_errors(args):
        errors = [([], [], ConfigError(problem)) for problem in flag_errors]
    elif args.info or args.shell_completion or args.cfg or args.config_path:
        return  # Hydra answers these itself (another primary config folder: its own schema, if any)
    elif args.config_dir and (not os.path.isdir(args.config_dir)
                              or any(o.lstrip("+~").startswith("hydra.searchpath") for o in args.overrides)):
        return  # (a folder that is not there, or where Hydra looks given too: Hydra's to say)
    else:
        from .command_line import hydra_string

        # A folder added to where Hydra looks (--config-dir: the user's own experiment options), added here too.
        searched = [f"hydra.searchpath=[{hydra_string('file://' + os.path.abspath(args.config_dir))}]"] \
            if args.config_dir else []
        errors = list(_job_errors(args.overrides, args.multirun, config_dir, args.config_name or config_name,
                                  check or check_train_job, searched))
    for line in _error_lines(errors, _jobs_in_sweep(args.overrides) if args.multirun and errors else None):
        print(f"ddlx: error: {line}", file=sys.stderr)
    if errors:
        from .parallel.mpi_ranks import abort_job

        abort_job(2, show_traceback=False)  # one rank of mpirun or srun refused alone: the others would wait for it
        raise SystemExit(2)


def _config_holds_sweeper_params(overrides: list[str], config_dir: Path, config_name: str, searched) -> bool:
    """Whether the config ``overrides`` compose (a sweep's first job) gives ``hydra.sweeper.params``
    (an experiment option may); True where that cannot be told (left to Hydra)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    try:
        first = _sweep_jobs(overrides)[0]
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3", job_name=_task_name(config_name)):
            cfg = compose(config_name=config_name, overrides=[*first, *searched], return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, IndexError):
        return True
    return OmegaConf.select(cfg, "hydra.sweeper.params", default=None) is not None


def _error_lines(errors: list, jobs: int | None) -> list[str]:
    """A line per refused job, its sweep values first (``jobs``: how many the sweep has, None for
    a single run); every job of a sweep refused for one reason (a value they share), one line."""
    said = [str(err) for _, _, err in errors]
    if jobs is not None and len(errors) == jobs > 1 and len(set(said)) == 1:
        return [f"all {jobs} jobs of the sweep: {said[0]}"]
    return [(f"sweep job {' '.join(swept)}: " if jobs is not None and swept else "") + line
            for (_, swept, _), line in zip(errors, said)]


def _jobs_in_sweep(overrides: list[str]) -> int | None:
    from hydra.errors import HydraException

    try:
        return len(_sweep_jobs(overrides))
    except HydraException:  # (said as the sweep's error)
        return None


def _flag_errors(args) -> list[str]:
    """Hydra's flags, alone or together, that Hydra answers with a ValueError's or omegaconf's traceback."""
    given = [flag for flag, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg is not None),
                                   ("--info", args.info is not None), ("--shell-completion", args.shell_completion)) if on]
    if len(given) > 1:
        return [f"{' and '.join(given)} given together; Hydra takes one of --run, --multirun, --cfg, --info and "
                f"--shell-completion: drop all but one"]
    if args.experimental_rerun is not None and not Path(args.experimental_rerun).is_file():
        return [f"--experimental-rerun {args.experimental_rerun}: no such file; expected a job's config.pickle, "
                f"which Hydra's PickleJobInfoCallback (hydra.experimental.callbacks) writes in a job's .hydra folder"]
    if args.cfg == "hydra" and args.resolve:  # Hydra drops the job's keys, then resolves what is left
        package = args.package if (args.package or "").startswith("hydra") else "hydra"
        return [f"--cfg hydra --resolve cannot resolve Hydra's folders: hydra.run.dir and hydra.sweep.dir name "
                f"paths.root, which --cfg hydra leaves out; to see them resolved: --cfg all --resolve --package {package}"]
    return []


def _job_errors(overrides: list[str], multirun: bool, config_dir: Path, config_name: str, check, searched=()):
    """(job's overrides, those that vary across the sweep's jobs, error) for each job refused;
    ``searched``: a ``hydra.searchpath`` override for the folders --config-dir adds."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import (
        HydraException,
        MissingConfigException,
        OverrideParseException,
    )

    if any(o.lstrip("+~").startswith("hydra/sweeper") for o in overrides):
        return  # another sweeper expands the jobs (and checks them as it composes each)
    if given := [o for o in overrides if o.lstrip("+~").startswith("hydra.sweeper.params")]:
        if not _config_holds_sweeper_params([o for o in overrides if o not in given], config_dir, config_name, searched):
            yield [], [], ConfigError(
                f"{given[0]}: Hydra's basic sweeper takes params on the command line only where a config file has "
                f"given it some (on none, Hydra fails); give the sweep as overrides (python "
                f"{ENTRIES.get(config_name, ('train.py',))[0]} -m seed=1,2), or set hydra.sweeper.params in an "
                f"experiment option (docs/measuring.md)")
        return  # (the sweeper's jobs come from its params: left to it, as before)
    if any(o.lstrip("+~").startswith("hydra.sweeper") for o in overrides):
        return  # the basic sweeper's own settings (max_batch_size): its jobs are the overrides' still
    try:
        jobs = _sweep_jobs(overrides)
    except OverrideParseException as err:
        yield [], [], ConfigError(f"cannot read the overrides {' '.join(overrides)!r}: {_first_line(err)} "
                                  f"(the syntax: https://hydra.cc/docs/advanced/override_grammar/basic)")
        return
    except HydraException as err:  # sweep syntax the basic sweeper cannot expand (interval, ...)
        yield [], [], ConfigError(f"{_first_line(err)}: Hydra's basic sweeper takes lists (a,b), range() and "
                                  f"glob(); a sweeper plugin (hydra/sweeper=...) takes the others")
        return
    if not multirun:
        jobs = [list(overrides)]  # a run takes sweep syntax (a,b) only under -m, where Hydra says so
    shared = set.intersection(*(set(job) for job in jobs)) if jobs else set()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3", job_name=_task_name(config_name)):
        for number, job in enumerate(jobs):
            raise_held_ctrl_c()  # a Ctrl-C held while the last job was composed stops here
            swept = [o for o in job if o not in shared]
            elsewhere = [other_entry_problem(o.split("=")[0], config_name) for o in job] if config_name in ENTRIES else []
            if any(elsewhere):  # Hydra's own words would be "no match in the defaults list", then a missing schema
                yield job, swept, ConfigError(next(p for p in elsewhere if p))
                continue
            if not searched and (missing := _missing_options(job)):  # (the loader knows conf/ alone)
                yield job, swept, ConfigError("; ".join(missing))
                continue
            try:
                cfg = compose(config_name=config_name, overrides=[*job, *searched], return_hydra_config=True)
                with _hydra_config_as_in_the_job(cfg, multirun, number):
                    check(cfg, multirun)
            except ConfigError as err:
                yield job, swept, err
            except MissingConfigException as err:
                yield job, swept, ConfigError(_missing_option(err))
            except HydraException as err:
                cause = err.__cause__
                yield job, swept, explain(cause) if isinstance(cause, OmegaConfBaseException) else ConfigError(_hydra_message(err, job))
        raise_held_ctrl_c()  # and one held in the last: Hydra has not made the job's folder yet


def check_train_job(cfg: DictConfig, multirun: bool) -> None:
    """One job of the command line (composed with Hydra's own config): its folder can be made,
    its config is typed and within bounds (:func:`check_config`), and what else can be known
    before torch loads holds (:mod:`ddlx.preflight`)."""
    from . import preflight

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        folder = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except OmegaConfBaseException as err:
        raise explain(err) from None
    job_folder = OmegaConf.select(cfg, "hydra.runtime.output_dir", default=None)
    launcher = OmegaConf.select(cfg, "hydra.launcher._target_", default=None)
    with open_dict(cfg):
        cfg.pop("hydra")
    typed = typed_config(cfg)
    preflight.check_before_torch(typed)  # first: an empty paths.root is why the run folder is /outputs
    problem = preflight.run_folder_problem(folder, key) if folder else None
    if problem:
        raise ConfigError(problem)
    if job_folder is not None:  # (the command line's check: Hydra's config is there)
        _check_store(typed.logger.tracking_uri, job_folder, launcher)


def _check_store(uri: str, job_folder: str, launcher: str | None, **how) -> None:
    """The store a job records to, checked from the command line as the run will check it when it
    opens (its folder, whether it can be written, a server's health), so that the job is refused
    before Hydra makes its folder: once per store of a command line (a server that does not answer
    waits its timeout once). Where a launcher plugin runs the jobs on other hosts (submitit), only
    what its words tell: the store is theirs to reach."""
    from .tracking import check_tracking_uri, sqlite_path

    if launcher is not None and not launcher.endswith("BasicLauncher"):
        return  # (its words were checked with the config's other values)
    made_later = Path(job_folder) if sqlite_path(uri) is not None else None  # (only a database file's folder)
    key = (uri, made_later, tuple(sorted(how.items())))
    if key not in _STORES_CHECKED:
        try:
            check_tracking_uri(uri, made_later=made_later, **how)
            _STORES_CHECKED[key] = None
        except ConfigError as err:
            _STORES_CHECKED[key] = err
    if (err := _STORES_CHECKED[key]) is not None:
        raise err


_STORES_CHECKED: dict[tuple, ConfigError | None] = {}  # this command line's (check_command_line empties it)


def check_recommend_job(cfg: DictConfig, multirun: bool, hw_dir: Path) -> None:
    """recommend.py's job: no folder key empty, its data folder there (for an answer, which reads
    it), its data values consistent (as train.py's, :mod:`.preflight`), its hardware one of the
    descriptions in ``hw_dir``, not the schema they extend (an option of the group, but no machine)."""
    from . import preflight
    from .predict.choices import check_strategies, check_tries
    from .tracking import store_uri_problem

    options = sorted(p.stem for p in hw_dir.glob("*.yaml"))
    if OmegaConf.select(cfg, "hydra.runtime.choices.hw") == "schema":  # (no hw.name: logger.run_name would not resolve)
        raise ConfigError(f"hw=schema is the fields every machine description has, not a machine; "
                          f"expected one of {', '.join(options)}")
    try:
        problem = _machine_choice_problem(cfg, options)
    except OmegaConfBaseException:  # a value that does not resolve: named as the config is typed
        problem = None
    if problem:
        raise ConfigError(problem)
    # Typed, as the job types it: a wrong type, a range, a value that does not resolve (Hydra's
    # folder is made after this, and an override that does not resolve fails as Hydra reads it back).
    typed = typed_recommend_config(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]))
    check_strategies(typed.strategies)
    check_tries(typed.candidates)
    reads_data = OmegaConf.select(cfg, "mode", default="recommend") == "recommend"  # (validate and probe do not)
    problems = [*preflight.empty_folders(lambda key: OmegaConf.select(cfg, key, default=None)),
                *(preflight.data_root_problems(cfg.data) if reads_data else []), *preflight.data_problems(cfg.data)]
    if (uri := OmegaConf.select(cfg, "logger.tracking_uri", default=None)) is not None and (problem := store_uri_problem(uri)):
        problems.append(problem)
    if problems:
        raise ConfigError("; ".join(problems))
    job_folder = OmegaConf.select(cfg, "hydra.runtime.output_dir", default=None)  # None: in the job (it checks its store)
    if uri is not None and job_folder is not None and OmegaConf.select(cfg, "mode") == "recommend" and OmegaConf.select(cfg, "log"):
        _check_store(uri, job_folder, OmegaConf.select(cfg, "hydra.launcher._target_", default=None), read_only_option="log=false")


def _machine_choice_problem(cfg: DictConfig, options: list[str]) -> str | None:
    """What is wrong with recommend.py's compare= and max_epoch_s=, said in their words (before
    the typed config's "a list of strings")."""
    compare = OmegaConf.select(cfg, "compare", default=None)
    compare = [] if compare is None else compare
    if not (OmegaConf.is_list(compare) or isinstance(compare, list)):
        return f"compare={compare}; expected a list of hw names, e.g. compare=[a100_sxm4_40gb_8x,h100_1x]"
    for name in compare:
        if name not in options or name == "schema":
            return (f"compare={list(compare)}: {name!r} is not a machine description; expected names of "
                    f"{', '.join(o for o in options if o != 'schema')}")
    limit = OmegaConf.select(cfg, "max_epoch_s", default=None)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
        return f"max_epoch_s={limit}; expected seconds > 0 an epoch may take (or null), e.g. max_epoch_s=600"
    return None


def _task_name(config_name: str) -> str:
    """The job's name as Hydra gives it (``hydra.job.name``): its script's name, as run."""
    script = Path(sys.argv[0])
    return script.stem if script.suffix == ".py" else config_name


@contextmanager
def _hydra_config_as_in_the_job(cfg: DictConfig, multirun: bool, number: int) -> Iterator[None]:
    """Hydra's config set, as Hydra sets it when it runs the job (its number in a sweep, then its
    folder: hydra.core.utils.run_job), so that ``${hydra:...}`` in the job's values resolves as in
    the job (``paths.root=${hydra:runtime.cwd}/runs``, ``logger.run_name=job${hydra:job.num}``);
    the state before is set back after."""
    from hydra.core.hydra_config import HydraConfig

    instance = HydraConfig.instance()
    before = instance.cfg
    try:
        with read_write(cfg.hydra), open_dict(cfg.hydra):
            if multirun:
                cfg.hydra.job.id = number
                cfg.hydra.job.num = number
        instance.set_config(cfg)
        try:
            folder = str(OmegaConf.select(cfg, "hydra.sweep.dir" if multirun else "hydra.run.dir",
                                          throw_on_resolution_failure=True))
            if multirun:
                folder = os.path.join(folder, str(OmegaConf.select(cfg, "hydra.sweep.subdir", throw_on_resolution_failure=True)))
        except OmegaConfBaseException:
            pass  # the check names what does not resolve
        else:
            with read_write(cfg.hydra), open_dict(cfg.hydra):
                cfg.hydra.runtime.output_dir = os.path.abspath(folder)
            instance.set_config(cfg)
        yield
    finally:
        instance.cfg = before


def _sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The overrides of each job of a sweep, as Hydra's basic sweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    batches = BasicSweeper.split_arguments(parsed, None)
    return [job for batch in batches for job in batch]


def _missing_option(err) -> str:
    text = _first_line(err)
    missing = getattr(err, "missing_cfg_file", "") or ""
    group, _, option = missing.rpartition("/")
    options = _pickable(getattr(err, "options", None) or [])
    if group and options:
        return _not_an_option(group, option, options)
    return text


def _pickable(options: Sequence[str]) -> list[str]:
    """A group's options a user may choose: its schema is the fields they fill, not one of them."""
    return [o for o in options if not o.startswith("schema")]


def _not_an_option(group: str, option: str, options: Sequence[str]) -> str:
    return (f"{group}={option} is not an option of {group}{did_you_mean(option, options, f'{group}=')}; "
            f"expected one of {', '.join(sorted(options))}")


def _missing_options(job: list[str]) -> list[str]:
    """Every ``group=option`` of ``job`` whose option the config tree lacks, each named with its
    options (Hydra, composing, stops at the first). Inside ``initialize_config_dir``."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    found = []
    for override in OverridesParser.create().parse_overrides(job):
        if override.is_delete() or override.is_sweep_override() or not isinstance(override.value(), str):
            continue
        options = loader.get_group_options(override.key_or_group)
        if options and override.value() not in options:  # hw=schema is one (refused with its own reason)
            found.append(_not_an_option(override.key_or_group, override.value(), _pickable(options)))
    return found


def _hydra_message(err, job: Sequence[str] = ()) -> str:
    text = str(err).strip()
    if "Could not append to config. An item is already at" in text:
        key = text.split("'")[1]
        return f"{key} already exists, so it takes no '+': set it as {key}=VALUE"
    chosen = re.match(r"Multiple values for (\S+)\. To override a value use 'override \S+: (.+)'", text)
    if chosen and any(o.startswith(f"+{chosen[1]}=") for o in job):  # (else a defaults list's, whose fix Hydra names)
        group, option = chosen.groups()
        return f"{group} is a group the config chooses already, so it takes no '+': choose it as {group}={option}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())
