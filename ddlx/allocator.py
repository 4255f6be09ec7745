"""How the C heap treats freed memory in a training process (``cpu_allocator``).

glibc's default ("system") serves each block above its mmap threshold (which adapts, up to
32 MiB) with a fresh ``mmap`` and hands it back on free, so a step whose activations exceed it
page-faults them in again every step. "keep_freed" serves every block from the heap and never
trims it (``mallopt(M_MMAP_MAX, 0)`` and a trim threshold of 2 GiB, and the same as
``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_`` for the processes it starts): freed memory is
reused, at the price of a higher peak RSS (measurements: docs/allocator.md).

glibc cannot go back to its adaptive default within a process, so a process that set
"keep_freed" refuses a later "system" job (a Hydra sweep runs its jobs in one process).

A malloc replacement started with the process through ``LD_PRELOAD`` (jemalloc, tcmalloc,
mimalloc: what PyTorch's CPU performance tuning guide suggests) serves every allocation instead
of glibc, in the ranks too (they inherit the environment). Its name is then the
``cpu_allocator`` value, so its runs are a population of their own; "system" or "keep_freed"
with one loaded, or its name without it, is refused: the run would be recorded under an
allocator it did not use.

"auto", the default, is what this process can best run and record: the preloaded replacement if
one serves malloc, else "keep_freed" on glibc (faster data-parallel CPU training, and the
population recommend.py ranks right), else "system". A run records what it resolved to.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

from .errors import ConfigError

SYSTEM = "system"  # glibc as it comes; also what runs from before the setting used
KEEP_FREED = "keep_freed"
AUTO = "auto"  # resolved by resolve_allocator before anything else sees it
# The malloc replacements a run may name: the file-name stem of the shared library, and the
# library to preload and the Debian package that has it, for the error that asks for it.
REPLACEMENTS = {"jemalloc": ("libjemalloc", "libjemalloc.so.2", "libjemalloc2"),
                "tcmalloc": ("libtcmalloc", "libtcmalloc_minimal.so.4", "libtcmalloc-minimal4"),
                "mimalloc": ("libmimalloc", "libmimalloc.so.2", "libmimalloc2.0")}
# The environment each replacement reads its tuning from (variables starting so). Not recorded
# with a run, and it changes the timings (docs/allocator.md), so a run with it set is refused
# rather than mixed with the default's.
TUNING_ENV = {"jemalloc": "MALLOC_CONF", "tcmalloc": "TCMALLOC_", "mimalloc": "MIMALLOC_"}
CHOICES = (SYSTEM, KEEP_FREED, *REPLACEMENTS)  # what a run records
# mallopt's parameters (malloc.h) and the values "keep_freed" sets.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap before any is returned
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the adaptive threshold never rises above it, so
# under "system" every block this large is mapped afresh on each allocation, whatever came before.
MMAP_CEILING_BYTES = 32 * 2**20
KEEP_FREED_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}

_set_here: str | None = None  # what this process set, if anything


def _glibc():
    """glibc's handle, or None elsewhere (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def malloc_library() -> str | None:
    """The path of the shared library whose ``malloc`` this process calls (the C library's, or
    a replacement's interposed through ``LD_PRELOAD``), or None where the loader cannot say."""
    found = _defining("malloc")
    if found is not None and found[1] == _main_program_start():
        # A non-PIE executable that takes malloc's address (Debian's and uv's Pythons among them)
        # defines the symbol at its own PLT entry, which the loader binds to the first
        # preloaded library that has malloc, else the C library's. dladdr names the executable
        # by the argv[0] it was started with ("python3" found through PATH, a relative path), so
        # its name does not say that it is the executable: where it is loaded does.
        return next((lib for lib in _preloaded() if _same_file(_library_defining("malloc", lib), lib)), None)
    return found[0] if found else None


def _library_defining(symbol: str, within: str | None = None) -> str | None:
    """The file ``dladdr`` names for the address this process (or the library ``within`` and
    what it needs) resolves ``symbol`` to."""
    found = _defining(symbol, within)
    return found[0] if found else None


def _defining(symbol: str, within: str | None = None) -> tuple[str, int] | None:
    """(the file ``dladdr`` names, the address it is loaded at) for ``symbol``'s address."""
    try:
        address = getattr(ctypes.CDLL(within), symbol)
        dladdr = ctypes.CDLL(None).dladdr
    except (OSError, AttributeError, TypeError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not dladdr(ctypes.cast(address, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname), info.dli_fbase or 0


def _main_program_start() -> int | None:
    """The address of the executable's first mapping in /proc/self/maps (what dladdr gives as its base)."""
    executable = os.path.realpath("/proc/self/exe")
    try:
        with open("/proc/self/maps") as maps:
            return next((int(line.split("-", 1)[0], 16) for line in maps if line.rstrip().endswith(" " + executable)), None)
    except OSError:
        return None


def _preloaded() -> list[str]:
    return os.environ.get("LD_PRELOAD", "").replace(":", " ").split()


def _same_file(found: str | None, library: str) -> bool:
    """Whether the path ``dladdr`` gave is ``library`` as LD_PRELOAD names it (a path or a file name)."""
    return found is not None and (os.path.realpath(found) == os.path.realpath(library) or
                                  os.path.basename(found) == os.path.basename(library))


def replacement_of(library: str | None) -> str | None:
    """The :data:`REPLACEMENTS` name of a malloc library's path; None for the C library's own (or
    an unknown one, whose path the caller names)."""
    name = os.path.basename(library or "")
    return next((choice for choice, (stem, _, _) in REPLACEMENTS.items() if name.startswith(stem)), None)


def _is_libc(library: str | None) -> bool:
    """Whether malloc is the C library's own (glibc, musl, macOS's), or the loader cannot say."""
    return library is None or os.path.basename(library).startswith(("libc.so", "libc-", "ld-musl", "libsystem_malloc"))


def _served_from(library: str | None) -> str:
    """Where malloc comes from, for an error: the library, and the LD_PRELOAD that put it there."""
    preload = os.environ.get("LD_PRELOAD", "")
    return f"{library}{f' (LD_PRELOAD={preload})' if preload else ''}"


# The fix when a malloc ddlx cannot name serves the process.
UNNAMED_FIX = f"unset LD_PRELOAD, or preload one of {', '.join(REPLACEMENTS)}"


def resolve_allocator(choice: str) -> str:
    """``choice``, with "auto" replaced by what this process runs: the preloaded replacement serving
    malloc, else keep_freed on glibc, else system. Anything else is returned as given."""
    if choice != AUTO:
        return choice
    library = malloc_library()
    serving = replacement_of(library)
    if serving:
        return serving
    if not _is_libc(library):
        raise ConfigError(f"cpu_allocator=auto, but malloc in this process comes from {_served_from(library)}, which "
                          f"ddlx cannot name: its runs would be recorded under an allocator they did not use; {UNNAMED_FIX}")
    return KEEP_FREED if _glibc() is not None else SYSTEM


def explain(requested: str, resolved: str) -> str:
    """What a run's heap is set to and why, for its first log lines."""
    why = {SYSTEM: "glibc's default: blocks of 32 MiB or more are mapped afresh at every allocation",
           KEEP_FREED: "glibc keeping freed memory for reuse (no fresh mappings per step, a higher peak RSS)"}
    how = why.get(resolved, f"the malloc preloaded with LD_PRELOAD ({resolved})")
    chosen = (f"cpu_allocator={AUTO} (the default) resolved to {resolved}" if requested == AUTO
              else f"cpu_allocator={resolved}")
    return (f"{chosen}: {how}; runs are compared only with runs of the same allocator "
            f"(cpu_allocator=system for glibc's default; docs/allocator.md)")


def check_allocator(choice: str) -> None:
    """Refuse a ``cpu_allocator`` this process cannot honour, or would record wrongly, before any
    work. ``choice`` is resolved (see :func:`resolve_allocator`)."""
    if choice not in CHOICES:
        raise ConfigError(f"cpu_allocator={choice!r} is not one of {AUTO}, {', '.join(CHOICES)}: use cpu_allocator=auto "
                          f"(the default), cpu_allocator=system "
                          f"(glibc's default) or cpu_allocator=keep_freed (reuse freed memory; faster data-parallel "
                          f"CPU training on large activations), or start train.py with a malloc replacement in "
                          f"LD_PRELOAD and name it")
    if choice in TUNING_ENV:
        tuned = sorted(k for k in os.environ if k.startswith(TUNING_ENV[choice]))
        if tuned:
            raise ConfigError(f"cpu_allocator={choice}, but {', '.join(tuned)} is set in the environment: it tunes "
                              f"{choice}, changes the timings and is not recorded with the run, whose times would be "
                              f"compared with {choice}'s defaults; unset it")
    library = malloc_library()
    serving = replacement_of(library)
    if choice in REPLACEMENTS and serving != choice:
        _, soname, package = REPLACEMENTS[choice]
        raise ConfigError(f"cpu_allocator={choice}, but malloc in this process comes from {library or 'the C library'}: "
                          f"start it with {choice}'s library preloaded, e.g. LD_PRELOAD={soname} python train.py ... "
                          f"cpu_allocator={choice} (Debian: apt-get install {package}), so that it and the ranks it "
                          f"starts allocate with {choice}; or use cpu_allocator=system")
    if choice in (SYSTEM, KEEP_FREED) and not _is_libc(library):
        fix = (f"use cpu_allocator={serving}, or unset LD_PRELOAD" if serving else
               f"ddlx records only {', '.join(REPLACEMENTS)} by name: {UNNAMED_FIX}")
        raise ConfigError(f"cpu_allocator={choice}, but malloc in this process comes from {_served_from(library)}, not "
                          f"the C library: the run would be recorded under an allocator it does not use; {fix}")
    if choice == KEEP_FREED and _glibc() is None:
        raise ConfigError("cpu_allocator=keep_freed sets glibc's mallopt, and this C library is not glibc: "
                          "use cpu_allocator=system")
    if choice == SYSTEM:
        if _set_here == KEEP_FREED:
            raise ConfigError("cpu_allocator=system after a cpu_allocator=keep_freed job (or auto, which is keep_freed "
                              "on glibc) in the same process: glibc "
                              "cannot return to its default, so this job would be measured with the other allocator; "
                              "run the cpu_allocator=system jobs in a train.py call (or sweep) of their own")
        preset = sorted(k for k in KEEP_FREED_ENV if k in os.environ)
        if preset:
            raise ConfigError(f"cpu_allocator=system, but {', '.join(preset)} is set in the environment, which changes "
                              f"glibc's allocator for this run: unset it, or use cpu_allocator=keep_freed, which sets "
                              f"these for you and records it with the run")


def keep_freed_possible() -> bool:
    """Whether this process could run ``cpu_allocator=keep_freed``: glibc serves its malloc."""
    return _glibc() is not None and _is_libc(malloc_library())


def release_free_heap() -> None:
    """Hand the heap's free pages back to the system now (glibc's ``malloc_trim``; elsewhere
    nothing), whatever the trim threshold: what a process freed before it forks (its loader
    workers) is otherwise in each child too, and the child keeps its own copy of every such page
    the parent reuses after the fork."""
    if keep_freed_possible():  # glibc serves malloc
        _glibc().malloc_trim(0)


def apply_allocator(choice: str) -> None:
    """Set ``choice`` in this process and, through the environment, in the processes it starts."""
    global _set_here
    check_allocator(choice)
    if choice == KEEP_FREED:
        libc = _glibc()
        if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
            raise ConfigError("cpu_allocator=keep_freed: glibc's mallopt refused the settings; use cpu_allocator=system")
        os.environ.update(KEEP_FREED_ENV)
        _set_here = choice
