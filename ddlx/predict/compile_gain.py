"""Whether torch.compile pays for the run asked about: its steady-state gain and its compile
seconds, measured on the target by compiled runs beside eager runs of the same network and setup.

Compiling costs seconds once per run (far less where inductor's on-disk cache already holds the
graphs: a run that compiled none afresh is no measure of a first compile) and changes every step
after: it pays after ``compile_s / (epoch_s x (1 - factor))`` epochs, never where the
compiled step is not faster. Nothing here is assumed: without a compiled run of the network on
the target there is no gain to predict, and the answer says how to measure one."""
from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..compiling import compiled_most
from ..job import Job
from ..records import MeasuredRun, not_measured, on_hardware, speed_knobs_of, unmodelled
from ..costmodel.hardware import HardwareSpec


@dataclass(frozen=True)
class CompileGain:
    factor: float  # compiled / eager steady-state epoch: the median over the setups measured both ways
    compile_s: float  # what compiling cost a compiled run: the median compile_s of those that compiled their graphs
    warm_only: bool  # every compiled run took most of its graphs from inductor's cache: compile_s is a warm cache's
    setups: tuple[str, ...]  # the setups measured both ways
    runs: int  # the compiled runs the factor rests on
    compile_runs: int  # those compile_s rests on
    model: str

    def break_even_epochs(self, epoch_s: float) -> float | None:
        """Epochs of ``epoch_s`` (eager) after which the compiled run has caught up; None: never."""
        saved = epoch_s * (1 - self.factor)
        return None if saved <= 0 else self.compile_s / saved

    def pays(self, epoch_s: float, epochs: int | None) -> bool:
        """Compiling makes a run of ``epochs`` epochs shorter (unknown epochs: no)."""
        even = self.break_even_epochs(epoch_s)
        return even is not None and epochs is not None and epochs > even

    @property
    def basis(self) -> str:
        which = (f"all {self.runs} compiled run(s), each with most graphs from inductor's cache: a first compile costs more"
                 if self.warm_only else f"the {self.compile_runs} of {self.runs} compiled run(s) that compiled their graphs")
        return (f"compiled/eager x{self.factor:.3f}, the median over {len(self.setups)} setup(s) of {self.model} measured "
                f"both ways on this hardware ({', '.join(self.setups)}), compiling {self.compile_s:.0f} s a run "
                f"(the median of {which})")


def compiled(run: MeasuredRun) -> bool:
    """A run with compile.enable and every other speed knob at its default."""
    return speed_knobs_of(run.params) == {"compile.enable": "True"}


def compiled_afresh(run: MeasuredRun) -> bool:
    """A compiled run that compiled at least as many graphs as it took from inductor's cache (runs
    without the counts, logged before ddlx took them, are taken to have)."""
    return compiled_most(run.metrics.get("compile_cache_hits", 0.0), run.metrics.get("compile_cache_misses", 0.0))


def measured_gain(runs: Sequence[MeasuredRun], job: Job, hw: HardwareSpec, setup: str | None = None) -> CompileGain | None:
    """The gain of compiling ``job``'s network on ``hw`` from its runs there: each setup measured
    eager and compiled at the same workload (image size, batch, data) gives compiled/eager; the
    gain is ``setup``'s own where it is measured both ways, else the median over the setups that
    are. None where no setup is."""
    mine = [r for r in runs if on_hardware(r, hw) and r.params.get("model.name") == job.model and not_measured(r) is None
            and r.mean_epoch_time_s and r.workload.cpu_allocator == job.cpu_allocator and r.workload.precision == job.precision]
    eager, comp = defaultdict(list), defaultdict(list)
    for run in mine:
        if compiled(run):
            comp[(run.workload, run.setup)].append(run)
        elif unmodelled(run) is None:
            eager[(run.workload, run.setup)].append(run)
    both = sorted(set(eager) & set(comp), key=lambda key: key[1])
    own = [key for key in both if key[1] == setup]
    both = own or both
    if not both:
        return None
    factors = [statistics.median(r.mean_epoch_time_s for r in comp[key]) /
               statistics.median(r.mean_epoch_time_s for r in eager[key]) for key in both]
    runs_compiled = [r for key in both for r in comp[key]]
    afresh = [r for r in runs_compiled if compiled_afresh(r)]  # what a run compiling its graphs pays
    costed = afresh or runs_compiled
    compile_s = statistics.median(r.metrics.get("compile_s", 0.0) for r in costed)
    return CompileGain(statistics.median(factors), compile_s, not afresh, tuple(dict.fromkeys(k[1] for k in both)),
                       len(runs_compiled), len(costed), job.model)

