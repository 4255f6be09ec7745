"""What recommend.py prints: the ranked table or JSON of a recommendation, the train.py commands
that run its setups, and the validation's tables and plot."""
from __future__ import annotations

import math
from pathlib import Path

from ..allocator import KEEP_FREED
from ..command_line import shell_words
from ..records import measurement_overrides
from ..strategies import BASELINE, spec_of
from .machines import Choice, MachineComparison
from .prediction import Prediction, Recommendation, allocator_advice, compilable
from .setups import is_baseline, overrides


def train_command(rec: Recommendation, prediction: Prediction, job_overrides: list[str]) -> str:
    """The train.py command that runs ``prediction``'s setup on the job: model and data, the
    user's own model/data overrides (the later of two for one key wins, as in Hydra), the setup,
    on a GPU machine its GPUs, started by the setup's launcher where one starts its ranks; on a
    described machine tagged as its run, so that the next answer about that machine counts it."""
    parts = {"model": f"model={rec.job.model}", "data": f"data={rec.job.data}"}
    for override in job_overrides:
        parts[override.split("=")[0]] = override
    for override in prediction.data_overrides:
        parts[override.split("=")[0]] = override
    if rec.hw.device_kind != "cpu" and "trainer" not in dict(prediction.setup.knobs):
        parts["trainer"] = "trainer=gpu"  # fsdp, mpi and hybrid would train on the CPU under the default trainer
    launcher = spec_of(prediction.setup.strategy).launcher(prediction.setup, rec.hw)  # its own words, a count
    return " ".join([*([launcher] if launcher else []), "python train.py",
                     shell_words(*parts.values(), *overrides(prediction.setup).split(), *hw_tag(rec))])


def figure(value: float, calibrated: bool) -> str:
    """A predicted figure to the digits its basis carries: three significant digits when
    calibrated on runs, two and marked ``~`` for an estimate."""
    digits = 3 if calibrated else 2
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    text = f"{round(value, decimals):.{max(decimals, 0)}f}"
    return text if calibrated else f"~{text}"


def calibration_commands(rec: Recommendation, prediction: Prediction, job_overrides: list[str]) -> list[str]:
    """What to run on the target to calibrate an estimate: its one-device baseline, unless runs of
    it at this batch are measured there already, and the setup itself, tagged with the hardware's
    name when it is not this machine."""
    baseline = rec.reference or next((p for p in rec.predictions if is_baseline(p.setup)), None)
    if baseline is not None and is_baseline(baseline.setup) and baseline.batch_size == rec.job.batch_size \
            and rec.sequential.measured:  # rec.sequential: the job's batch (a baseline may be asked at its own)
        baseline = None
    chosen = [p for p in (baseline, prediction) if p is not None and p.memory.fits]  # never a run that cannot be made
    return list(dict.fromkeys(measurement_command(rec, p, job_overrides) for p in chosen))


def measurement_command(rec: Recommendation, prediction: Prediction, job_overrides: list[str]) -> str:
    """The train.py command that measures ``prediction``'s setup on the job, for the answer to count
    (records.measurement_overrides: without them a small job's run was left out as not steady state;
    a large one's is one epoch, not train.py's five)."""
    steps = math.ceil(rec.job.train_samples / prediction.batch_size) if prediction.batch_size else None
    return train_command(rec, prediction, [*job_overrides, *measurement_overrides(steps)])


def hw_tag(rec: Recommendation) -> list[str]:
    """What tags a run made on a described machine as that machine's (records.on_hardware), so that
    the next answer about it counts the run; nothing for this machine, whose runs carry its host."""
    return [f"++logger.tags.hw={rec.hw.name}"] if rec.hw.name != "local" else []  # ++: also where a logger config sets it


MEMORY_BASIS = ("memory/device: counted from the model, not measured: the weights, gradients and optimizer state "
                "each device holds, and the activations it keeps for backward at its (micro-)batch")


def recommendation_dict(rec: Recommendation, note: str, elapsed: float, close_call: float, job_overrides: list[str]) -> dict:
    best = rec.best

    def measured_by(p: Prediction) -> dict:
        return p.as_dict() | {"command": measurement_command(rec, p, job_overrides)}

    recommended = best.as_dict() | {"command": recommended_command(rec, best, job_overrides),
                                    "command_with_loading_fix": loading_fix_command(rec, best, job_overrides)} if best else None

    def costed(p: Prediction) -> dict:
        choice = Choice(rec, p)
        return p.as_dict() | {"devices": choice.devices, **({"epoch_cost": float(f"{choice.epoch_cost:.6g}")}
                                                            if choice.epoch_cost is not None else {})}

    return {
        "hw": rec.hw.name,
        "hw_overrides": list(rec.hw_overrides),
        "strategies": list(rec.strategies) or "all",
        "job": vars(rec.job) | {"steps_per_epoch": rec.job.steps},
        "runs": note,
        "sequential_basis": rec.sequential.basis,
        "speedup_over": speedup_over(rec),
        "price_per_device_hour": rec.hw.price_per_device_hour,
        "price_basis": rec.hw.price_basis or None,
        "predictions": [costed(p) for p in rec.predictions],
        "recommended": recommended,
        "compile": compile_dict(rec),
        "calibrate_with": calibration_commands(rec, best, job_overrides) if best and not best.calibrated else [],
        "memory_basis": MEMORY_BASIS,
        "close_call_band": close_call,
        "close_call_errors": {g: round(e, 4) for g, e in sorted(rec.errors.items())},
        "close_calls": [measured_by(p) for p in rec.close_calls(close_call)],
        "allocator_advice": allocator_advice_dict(rec, job_overrides),
        "seconds": round(elapsed, 2),
    }


def allocator_advice_dict(rec: Recommendation, job_overrides: list[str]) -> dict | None:
    why = allocator_advice(rec)
    if why is None:
        return None
    overrides = [o for o in job_overrides if not o.startswith("cpu_allocator=")]  # the user's, replaced
    return {"why": why, "command": train_command(rec, rec.best, [*overrides, f"cpu_allocator={KEEP_FREED}"])}


def recommendation_table(rec: Recommendation, note: str, elapsed: float, close_call: float, job_overrides: list[str]) -> str:
    j = rec.job
    batch = (f"batch {j.batch_size} per worker (data.batch_per=worker)" if rec.batches.per == "worker"
             else f"global batch {j.batch_size}")
    own = "".join(f", {name} {b}{' per pipeline' if rec.batches.per == 'worker' else ''}" for name, b in rec.batches.own)
    lines = [f"{j.model} on {j.data} ({j.image_size}px, {batch}{own}, {j.train_samples} training images) "
             f"on hw={rec.hw.name}: {rec.hw.nodes} node(s) x {rec.hw.devices_per_node} {rec.hw.device_kind}"
             f"{' cores' if rec.hw.device_kind == 'cpu' else 's'} ({rec.hw.device_name})",
             f"measured runs: {note}" + ("" if rec.runs_used else "; none usable: every figure below is a model estimate"),
             f"T_seq basis: {rec.sequential.basis}", ""]
    if rec.strategies:
        lines.insert(-1, f"ranked: only {', '.join(rec.strategies)} (strategies=[{','.join(rec.strategies)}]), "
                         f"beside the one-device setup")
    batches = len({p.batch_size for p in rec.predictions}) > 1  # a column only when the setups' batches differ
    over = speedup_over(rec)
    if over != "one device":
        lines.insert(-1, f"speedups over {over}: one device cannot hold this job")
    priced = rec.hw.price_per_device_hour is not None
    if priced:
        lines.insert(-1, f"cost: ${rec.hw.price_per_device_hour:g} per device-hour ({rec.hw.price_basis})")
    header = ["#", "setup", *(["global batch"] if batches else []), "epoch s", *(["$/epoch"] if priced else []),
              "speedup", "memory/device", "fits", "basis"]
    rows = []
    for i, p in enumerate(rec.predictions, 1):
        fits = "yes" if p.memory.fits else f"no (> {p.memory.limit_gb:.1f} GB of {p.memory.what})"
        rows.append([str(i), p.setup.label, *([str(p.batch_size)] if batches else []),
                     figure(p.epoch_s, p.calibrated), *([money(Choice(rec, p))] if priced else []),
                     f"{figure(p.speedup, p.calibrated)}x",
                     f"{p.memory.per_device_gb:.2f} GB",
                     fits, p.basis.replace(f"T_seq {rec.sequential.basis}", "T_seq").lstrip("; ") or "T_seq"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.append(MEMORY_BASIS)
    best = rec.best
    lines.append("")
    if best is None:
        lines.append("recommendation: none of these setups fits in memory; lower data.batch_size or use more devices")
    else:
        lines.append(f"recommendation: {best.setup.label}: {figure(best.epoch_s, best.calibrated)} s/epoch predicted, "
                     f"{figure(best.speedup, best.calibrated)}x {over} ({_headline_basis(rec, best)})")
        lines.append(f"  {recommended_command(rec, best, job_overrides)}")
        if best.loading_fix is not None:
            lines += loading_fix_lines(rec, best, loading_fix_command(rec, best, job_overrides))
        lines += compile_lines(rec, best, job_overrides)
        if not best.calibrated:
            commands = calibration_commands(rec, best, job_overrides)
            lines.append(f"  an estimate until runs on this hardware calibrate it; run {'these' if len(commands) > 1 else 'this'} "
                         f"there, then ask again:")
            lines += [f"    {command}" for command in commands]
        close = rec.close_calls(close_call)
        if close:
            validated = ", ".join(f"{g} {100 * e:.1f}%" for g, e in sorted(rec.errors.items()) if g != BASELINE)
            exact = f"; {BASELINE} measured at this batch, exact" if BASELINE in rec.errors else ""  # no leave-one-out figure
            lines.append(f"close calls: predicted within the models' error of it (the larger validated error of the two "
                         f"setups' groups, leave-one-out on this hardware's runs: {validated or 'none'}{exact}; "
                         f"{100 * close_call:.0f}% where a group has none), so measure them too before settling:")
            for p in close:
                lines.append(f"  {p.setup.label} ({100 * (p.epoch_s / best.epoch_s - 1):+.1f}%): "
                             f"{measurement_command(rec, p, job_overrides)}")
        advice = allocator_advice_dict(rec, job_overrides)
        if advice:
            lines.append(f"allocator: {advice['why']}:")
            lines.append(f"  {advice['command']}")
    lines.append(f"({elapsed:.1f} s)")
    return "\n".join(lines)


def recommended_command(rec: Recommendation, best: Prediction, job_overrides: list[str]) -> str:
    """The recommended setup's command, compiled where compiling pays for the run asked about."""
    return train_command(rec, best, job_overrides) + (" compile.enable=true" if rec.compile_pays else "")


def with_loading_fix(prediction: Prediction, job_overrides: list[str]) -> list[str]:
    """``job_overrides`` and the data.num_workers with which ``prediction``'s loaders keep up, if it names one."""
    fix = prediction.loading_fix
    return [*job_overrides, f"data.num_workers={fix[0]}"] if fix is not None else job_overrides


def loading_fix_command(rec: Recommendation, best: Prediction, job_overrides: list[str]) -> str | None:
    """The recommended command with the data.num_workers its loaders need to keep up (None: it keeps up)."""
    if best.loading_fix is None:
        return None
    gain = rec.compile_gain  # whether compiling pays, for the epoch with the loading hidden
    pays = gain is not None and gain.pays(best.loading_fix[1], rec.epochs) and compilable(best.setup)
    return train_command(rec, best, with_loading_fix(best, job_overrides)) + (" compile.enable=true" if pays else "")


def loading_fix_lines(rec: Recommendation, prediction: Prediction, command: str) -> list[str]:
    """Why ``prediction``'s loading holds it back, the epoch with enough workers, and ``command``, which has them."""
    workers, epoch_s = prediction.loading_fix
    why = ("it loads its data in the training process, between steps (data.num_workers=0)" if rec.job.num_workers == 0
           else f"its loaders cannot keep up at data.num_workers={rec.job.num_workers}")
    # the saving in words too: an estimate's two digits can print both epochs as the same figure
    saved = 100 * (1 - epoch_s / prediction.epoch_s)
    less = f"{saved:.1f}% less" if saved >= 0.1 else "under 0.1% less"
    return [f"  {why}; with data.num_workers={workers} it would take {figure(epoch_s, prediction.calibrated)} s/epoch "
            f"({less}):", f"  {command}"]


def compile_lines(rec: Recommendation, best: Prediction, job_overrides: list[str]) -> list[str]:
    """Whether torch.compile pays for the run asked about (trainer.max_epochs), from measured runs."""
    gain = rec.compile_gain
    if gain is None:
        unmeasured = f"torch.compile: no compiled run of {rec.job.model} measured on this hardware, so its gain is not predicted"
        if not compilable(best.setup):
            return [f"{unmeasured}; {best.setup.strategy} with these knobs cannot take compile.enable"]
        # an epoch to compile in and at least one to time: the user's trainer.max_epochs replaced where fewer
        epochs = [] if rec.epochs is not None and rec.epochs >= 2 else ["trainer.max_epochs=3"]
        # with the loaders that keep up: a pair of loader-bound runs would measure no gain
        measure = train_command(rec, best, [*with_loading_fix(best, job_overrides), "compile.enable=true",
                                            "measure.warmup_epochs=1", *epochs])
        return [f"{unmeasured}; measure it, and the same without compile.enable: {measure}"]
    even = gain.break_even_epochs(best.epoch_s)
    line = f"torch.compile: {gain.basis}: "
    if even is None:
        return [line + "the compiled step is not faster here; train eager"]
    line += f"compiling pays after {even:.1f} epochs of {figure(best.epoch_s, best.calibrated)} s"
    if rec.epochs is None:
        return [line + "; give trainer.max_epochs=N to be told whether it pays for your run"]
    saved = rec.epochs * best.epoch_s * (1 - gain.factor) - gain.compile_s
    if not compilable(best.setup):
        return [line + f"; {best.setup.strategy} with these knobs cannot take compile.enable"]
    verdict = (f"for trainer.max_epochs={rec.epochs} it saves {saved:.0f} s (compile.enable=true above)" if rec.compile_pays
               else f"for trainer.max_epochs={rec.epochs} it would cost {-saved:.0f} s more: train eager")
    return [f"{line}; {verdict}"]


def compile_dict(rec: Recommendation) -> dict | None:
    gain, best = rec.compile_gain, rec.best
    if gain is None or best is None:
        return None
    even = gain.break_even_epochs(best.epoch_s)
    return {"factor": round(gain.factor, 4), "compile_s": round(gain.compile_s, 2), "compile_s_runs": gain.compile_runs,
            "compile_s_warm_cache_only": gain.warm_only, "setups_measured": list(gain.setups),
            "compiled_runs": gain.runs, "break_even_epochs": None if even is None else round(even, 3),
            "epochs": rec.epochs, "pays": rec.compile_pays, "basis": gain.basis}


def money(choice: Choice) -> str:
    """An epoch's cost to the digits of its time's basis ("" where the machine gives no price)."""
    cost = choice.epoch_cost
    if cost is None:
        return ""
    text = figure(cost, choice.prediction.calibrated)
    return f"~${text[1:]}" if text.startswith("~") else f"${text}"


def _choice_line(choice: Choice) -> str:
    p, cost = choice.prediction, money(choice)
    return (f"{p.setup.label} on hw={choice.rec.machine}: {figure(p.epoch_s, p.calibrated)} s/epoch"
            + (f", {cost} an epoch on {choice.devices} device(s)" if cost else ""))


def comparison_lines(recs: list[Recommendation], comparison: MachineComparison, job_overrides: list[str]) -> list[str]:
    """The machines side by side (each one's fastest setup that fits), then the fastest overall and
    the cheapest within the stated time."""
    lines = ["", "machines: each one's fastest setup that fits" + (", an epoch's cost at its price per device-hour"
                                                                  if comparison.priced else "")]
    header = ["hw", "devices", "fastest setup", "epoch s", "$/epoch", "price basis"]
    rows = []
    for rec in recs:
        best = rec.best
        choice = Choice(rec, best) if best else None
        rows.append([rec.machine, f"{rec.hw.total_devices} x {rec.hw.device_name or rec.hw.device_kind}",
                     best.setup.label if best else "none fits", figure(best.epoch_s, best.calibrated) if best else "-",
                     (money(choice) if choice else "") or "-", rec.hw.price_basis or "no price given"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    if comparison.fastest is not None:
        lines.append(f"fastest: {_choice_line(comparison.fastest)}")
        lines += _choice_commands(comparison.fastest, job_overrides)
    limit = f" within max_epoch_s={comparison.max_epoch_s:g}" if comparison.max_epoch_s is not None else ""
    if comparison.cheapest is not None:
        lines.append(f"cheapest{limit}: {_choice_line(comparison.cheapest)}")
        lines += _choice_commands(comparison.cheapest, job_overrides)
    elif comparison.within == 0:
        lines.append(f"no setup that fits is predicted{limit}; the fastest is above")
    elif comparison.priced or limit:
        lines.append(f"cheapest{limit}: no machine that meets it gives a price (hw.price_per_device_hour)")
    return lines


def _choice_commands(choice: Choice, job_overrides: list[str]) -> list[str]:
    """A machine's chosen setup's command, and where its loading bounds it, the one with the workers that would not."""
    rec, p = choice.rec, choice.prediction
    lines = [f"  {train_command(rec, p, job_overrides)}"]
    if p.loading_fix is not None:
        lines += loading_fix_lines(rec, p, train_command(rec, p, with_loading_fix(p, job_overrides)))
    return lines


def comparison_dict(comparison: MachineComparison, job_overrides: list[str]) -> dict:
    def one(choice: Choice | None) -> dict | None:
        if choice is None:
            return None
        return {"hw": choice.rec.hw.name, "hw_overrides": list(choice.rec.hw_overrides),
                "setup": choice.prediction.setup.label, "devices": choice.devices,
                "predicted_epoch_s": round(choice.prediction.epoch_s, 4),
                "epoch_cost": None if choice.epoch_cost is None else float(f"{choice.epoch_cost:.6g}"),
                "command": train_command(choice.rec, choice.prediction, job_overrides),
                "loading_fix": choice.prediction.loading_fix_dict}

    return {"max_epoch_s": comparison.max_epoch_s, "fastest": one(comparison.fastest),
            "cheapest": one(comparison.cheapest), "setups_within": comparison.within}


def speedup_over(rec: Recommendation) -> str:
    """What the speedups are over, in words: one device, or the setup that stands for it."""
    reference = rec.reference
    return "one device" if reference is None or is_baseline(reference.setup) else reference.setup.label


def _headline_basis(rec: Recommendation, best: Prediction) -> str:
    if best.calibrated:
        return f"calibrated: T_seq {rec.sequential.basis.split(' (')[0]}, its model fitted to measured runs"
    why = rec.sequential.basis.removeprefix("estimate: ").split(" (")[0] if rec.sequential.estimated else \
        f"no measured {best.setup.strategy} run on {rec.hw.device_kind} hardware calibrates its model"
    return f"an estimate: {why}"


def validation_text(hw_name: str, note: str, rows, summary: dict, picks: dict, result: dict) -> str:
    """The validation's tables: every configuration, each strategy's errors, each workload's pick."""
    out: list[str] = []
    out.append(f"leave-one-configuration-out on hw={hw_name}: {note}\n")
    out.append("| workload | setup | measured s | predicted s | error |\n|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r.workload, r.measured_s)):
        out.append(f"| {r.workload} | {r.setup} | {r.measured_s:.2f} | {r.predicted_s:.2f} | {100 * r.error:+.1f}% |")
    out.append("\n| strategy | runs | median abs. error | mean abs. error |\n|---|---|---|---|")
    for g, s in sorted(summary.items()):
        out.append(f"| {g} | {s['runs']} | {100 * s['median_ape']:.1f}% | {100 * s['mape']:.1f}% |")
    out.append("\n| workload | recommended | measured fastest | recommended measured slower by | correct "
               "| resamples: fastest again / recommended fastest |\n|---|---|---|---|---|---|")
    for w, p in sorted(picks.items()):
        verdict = "T" if p.correct else "F, runs overlap" if p.overlapping else "F"
        out.append(f"| {w} | {p.recommended} | {p.fastest} | {100 * p.slowdown:.1f}% | {verdict} "
                   f"| {100 * p.fastest_reproduced:.0f}% / {100 * p.recommended_fastest:.0f}% |")
    if picks:
        n = len(picks)
        correct, near = (round(n * result[k]) for k in ("correct_fraction", "correct_or_overlapping_fraction"))
        out.append(f"\ncorrect recommendations: {correct}/{n} = {100 * correct / n:.0f}%; "
                   f"correct or with runs overlapping the fastest's (repeats do not tell them apart): "
                   f"{near}/{n} = {100 * near / n:.0f}%; the recommended setups measured "
                   f"{100 * result['mean_slowdown']:.1f}% slower than the fastest on average, at most "
                   f"{100 * result['max_slowdown']:.1f}%")
        out.append(f"resampling each setup's runs: the measured fastest is the fastest again in "
                   f"{100 * result['fastest_reproduced_fraction']:.0f}% of resamples (mean over workloads: what naming the "
                   f"measured fastest could expect against a re-measurement in the same sittings), the recommended setup in "
                   f"{100 * result['recommended_fastest_fraction']:.0f}%")
    return "\n".join(out)


def validation_plot(rows, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for group in sorted({r.group for r in rows}):
        pts = [r for r in rows if r.group == group]
        ax.scatter([r.measured_s for r in pts], [r.predicted_s for r in pts], label=group)
    top = max(max(r.measured_s, r.predicted_s) for r in rows) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax.plot([0, top], [0, 1.1 * top], color="grey", linewidth=0.5, linestyle=":")
    ax.plot([0, top], [0, 0.9 * top], color="grey", linewidth=0.5, linestyle=":")
    ax.set_xlabel("measured s/epoch")
    ax.set_ylabel("predicted s/epoch (leave-one-out)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
