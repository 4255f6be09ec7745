"""cpu_allocator: glibc's default against keeping freed memory, set in the process and its children."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
import textwrap


import pytest
from conftest import subprocess_env

from ddlx import allocator
from ddlx.allocator import (
    check_allocator,
    malloc_library,
    replacement_of,
    resolve_allocator,
)
from ddlx.errors import ConfigError

# How many more blocks glibc has mapped on their own while a 64 MiB block is held.
MAPPED_DURING_64MIB = textwrap.dedent("""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped_during_64mib():
        held = libc.mallinfo2().hblks
        block = libc.malloc(64 << 20)
        mapped = libc.mallinfo2().hblks - held
        libc.free(block)
        return mapped
""")


def test_an_unknown_allocator_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"cpu_allocator='hoard' is not one of auto, system, keep_freed, jemalloc, "
                                          r"tcmalloc, mimalloc: use cpu_allocator=auto \(the default\)"):
        check_allocator(resolve_allocator("hoard"))


def test_auto_resolves_to_keep_freed_on_glibc_and_to_system_elsewhere(monkeypatch):
    """auto is what the process can run and record; a named choice is kept as given."""
    assert allocator._glibc() is not None, "this test process runs on glibc"
    assert resolve_allocator("auto") == "keep_freed"
    assert [resolve_allocator(c) for c in ("system", "keep_freed", "jemalloc")] == ["system", "keep_freed", "jemalloc"]
    monkeypatch.setattr(allocator, "_glibc", lambda: None)  # musl, macOS: mallopt cannot be set
    assert resolve_allocator("auto") == "system"


def test_auto_under_a_malloc_ddlx_cannot_name_is_refused(monkeypatch):
    monkeypatch.setattr(allocator, "malloc_library", lambda: "/opt/hoard/libhoard.so")
    monkeypatch.setenv("LD_PRELOAD", "/opt/hoard/libhoard.so")
    with pytest.raises(ConfigError, match=r"cpu_allocator=auto, but malloc in this process comes from /opt/hoard/libhoard.so "
                                          r"\(LD_PRELOAD=/opt/hoard/libhoard.so\), which ddlx cannot name: .* unset "
                                          r"LD_PRELOAD, or preload one of jemalloc, tcmalloc, mimalloc"):
        resolve_allocator("auto")


def test_a_python_whose_executable_defines_malloc_runs_on_the_library_behind_it(monkeypatch):
    """Non-PIE Pythons (Debian's /usr/bin/python3, uv's standalone builds on the GPU machines)
    define malloc at their own PLT entry: dladdr names the executable, by the argv[0] it was
    started with, and the calls reach the C library (or the preloaded replacement). Every
    train.py there was refused before this was known, and started by a bare name until later."""
    executable, start = os.path.realpath("/proc/self/exe"), allocator._main_program_start()
    assert start is not None
    look_up = allocator._defining
    for name in (executable, "python3"):  # started by its path, or found through PATH
        monkeypatch.setattr(allocator, "_defining",
                            lambda symbol, within=None, name=name: (name, start) if within is None else look_up(symbol, within))
        monkeypatch.delenv("LD_PRELOAD", raising=False)
        assert malloc_library() is None, name
        assert resolve_allocator("auto") == "keep_freed"
        check_allocator("system")
        monkeypatch.setenv("LD_PRELOAD", "libm.so.6 libc.so.6")  # the first preloaded library that has malloc serves it
        assert malloc_library() == "libc.so.6"
        assert resolve_allocator("auto") == "keep_freed"


NON_PIE_PYTHON = "/usr/bin/python3.11"  # Debian's, on the build machine


@pytest.mark.skipif(not os.path.exists(NON_PIE_PYTHON), reason=f"no {NON_PIE_PYTHON}")
def test_a_non_pie_python_started_by_its_bare_name_is_not_refused():
    """argv[0] "python3.11", found through PATH: what dladdr names malloc's file by there."""
    script = "from ddlx.allocator import _defining, resolve_allocator; print(_defining('malloc')[0], resolve_allocator('auto'))"
    env = {**subprocess_env(), "PATH": f"{os.path.dirname(NON_PIE_PYTHON)}:{os.environ['PATH']}"}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([os.path.basename(NON_PIE_PYTHON), "-c", script], capture_output=True, text=True, env=env,
                         cwd="/", timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    named, chosen = out.stdout.split()
    if named != os.path.basename(NON_PIE_PYTHON):
        pytest.skip(f"{NON_PIE_PYTHON} does not define malloc itself here (dladdr named {named})")
    assert chosen == "keep_freed"


@pytest.mark.integration
def test_a_named_malloc_replacement_must_be_the_one_preloaded():
    assert replacement_of(malloc_library()) is None, "this test process runs with the C library's malloc"
    with pytest.raises(ConfigError, match=r"cpu_allocator=jemalloc, but malloc in this process comes from .*: start it with "
                                          r"jemalloc's library preloaded, e.g. LD_PRELOAD=libjemalloc.so.2 python train.py"):
        check_allocator("jemalloc")
    assert [replacement_of(p) for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/lib/libmimalloc.so.2",
                                        "/lib/x86_64-linux-gnu/libc.so.6", None)] == ["tcmalloc", "mimalloc", None, None]


def test_a_replacements_tuning_in_the_environment_is_refused(monkeypatch):
    """MALLOC_CONF tunes jemalloc and is not recorded: its runs would pass for the defaults'."""
    monkeypatch.setenv("MALLOC_CONF", "dirty_decay_ms:-1")
    with pytest.raises(ConfigError, match=r"cpu_allocator=jemalloc, but MALLOC_CONF is set in the environment: it tunes "
                                          r"jemalloc, .* unset it"):
        check_allocator("jemalloc")
    check_allocator("system")  # glibc does not read it


@pytest.mark.integration
@pytest.mark.skipif(ctypes.util.find_library("jemalloc") is None,
                    reason="needs jemalloc to preload (Debian: apt-get install libjemalloc2, as the README's setup does)")
def test_under_a_preloaded_jemalloc_only_its_name_is_accepted():
    code = textwrap.dedent("""
        from ddlx.allocator import check_allocator, keep_freed_possible, malloc_library, resolve_allocator
        from ddlx.errors import ConfigError

        print(malloc_library(), keep_freed_possible(), resolve_allocator("auto"))
        for choice in ("system", "keep_freed", "jemalloc"):
            try:
                check_allocator(choice)
                print(choice, "accepted")
            except ConfigError as err:
                print(choice, "refused:", err)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=subprocess_env() | {"LD_PRELOAD": "libjemalloc.so.2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    library, system, keep_freed, jemalloc = proc.stdout.strip().splitlines()
    assert "libjemalloc.so" in library and library.endswith("False jemalloc"), \
        "malloc is jemalloc's: keep_freed cannot run, and auto is jemalloc"
    for line, choice in ((system, "system"), (keep_freed, "keep_freed")):
        assert f"{choice} refused: cpu_allocator={choice}, but malloc in this process comes from" in line
        assert "(LD_PRELOAD=libjemalloc.so.2), not the C library" in line and "use cpu_allocator=jemalloc" in line
    assert jemalloc == "jemalloc accepted"


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.integration
@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc 2.33+ (mallinfo2) to count the mapped blocks")
def test_keep_freed_serves_large_blocks_from_the_heap_here_and_in_the_processes_it_starts():
    """Under glibc's default a 64 MiB block gets its own mapping (and is unmapped on free);
    keep_freed serves it from the heap, in this process (mallopt) and in the processes it starts
    (the environment), and a later "system" job in the same process is refused."""
    code = MAPPED_DURING_64MIB + textwrap.dedent("""
        import os, subprocess, sys
        from ddlx.allocator import apply_allocator, check_allocator
        from ddlx.errors import ConfigError

        before = mapped_during_64mib()
        apply_allocator("keep_freed")
        after = mapped_during_64mib()
        child = subprocess.run([sys.executable, "-c", sys.argv[1] + "print(mapped_during_64mib())"],
                               capture_output=True, text=True, check=True).stdout.strip()
        print(before, after, child)
        try:
            check_allocator("system")
        except ConfigError as err:
            print("refused:", err)
    """)
    proc = subprocess.run([sys.executable, "-c", code, MAPPED_DURING_64MIB], capture_output=True, text=True,
                          timeout=120, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts, refused = proc.stdout.strip().splitlines()
    assert counts.split() == ["1", "0", "0"], f"mapped blocks before / after / in a child: {counts}"
    assert "cpu_allocator=system after a cpu_allocator=keep_freed job (or auto, which is keep_freed on glibc) in the same process" in refused


def test_system_is_refused_when_the_environment_already_changes_glibcs_allocator(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    with pytest.raises(ConfigError, match=r"cpu_allocator=system, but MALLOC_MMAP_MAX_ is set in the environment"):
        check_allocator("system")
    check_allocator("keep_freed")  # what it asks for
