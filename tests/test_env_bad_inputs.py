"""The bad-input table of every ``QWEN4EXP_*`` variable the package reads at run time (README,
"Environment variables"): one case per variable and kind of mistake, with the message or warning
it must give, and the rule of that README section: the library's variables fail the import (or
the emulator's load) with a ValueError naming the variable and the value; the vLLM plugin's are
one warning in vLLM's log and the default; the bench's are a ValueError naming the variable.

Variables read at import are tried in a fresh interpreter (a subprocess with a timeout); the
others in this process, inside ``nothing_left_behind`` (no descriptor, mapping, thread or file
left). A call that could block (a FIFO, ``/dev/zero``) runs under a timeout."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from leak_support import nothing_left_behind
from qwen4exp_ext import _switches, simt
from qwen4exp_ext.bench import gather_rows, registry, staged_lookup, step_proxy, vllm_triton
from qwen4exp_ext.vllm import choice, prefetch, table_dir

TIMEOUT = 120  # seconds for a fresh interpreter (it imports torch) or a call that could block
INT64_OVER = str(1 << 63)
PLUGIN_LOG = "vllm.qwen4exp_ext"
FLAG_MESSAGE = "must be 1, true, on or yes (on) or 0, false, off or no (off)"


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``env`` added to this one's environment."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


@pytest.fixture
def plugin_warnings(caplog) -> Iterator[Callable[[], list[str]]]:
    """A function that returns the warnings the plugin logged so far (vLLM's logger may not
    propagate to caplog's root handler, so the handler is put on the plugin's logger itself);
    the once-per-process memory of warnings is cleared, so that each case sees its own."""
    logger = logging.getLogger(PLUGIN_LOG)
    propagate = logger.propagate
    logger.propagate = False  # each record once, through the handler put here
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger=PLUGIN_LOG)
    _switches._warned.clear()
    yield lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    logger.removeHandler(caplog.handler)
    logger.propagate = propagate
    _switches._warned.clear()


# ---- the library's variables: read at import, a bad value fails it -------------------------

IMPORT_CASES = [
    # (variable, value, what the error must say besides the variable and the value)
    ("QWEN4EXP_DEBUG_CHECKS", "ture", FLAG_MESSAGE),  # junk
    ("QWEN4EXP_DEBUG_CHECKS", "2", FLAG_MESSAGE),  # a number that is no flag
    ("QWEN4EXP_DEBUG_CHECKS", "-1", FLAG_MESSAGE),  # negative
    ("QWEN4EXP_CPU_GATHER_STREAM_BYTES", "x", "must be a byte count >= 0"),  # junk
    ("QWEN4EXP_CPU_GATHER_STREAM_BYTES", "-1", "must be a byte count >= 0"),  # negative
    ("QWEN4EXP_CPU_GATHER_STREAM_BYTES", "1e6", "must be a byte count >= 0"),  # exponent
    ("QWEN4EXP_CPU_GATHER_STREAM_BYTES", "12 MB", "must be a byte count >= 0"),  # unit
    ("QWEN4EXP_CPU_GATHER_STREAM_BYTES", " 12", "must be a byte count >= 0"),  # space
    # Past what the kernel's int64 setting holds: issue #47 item 14, failed in the op's cast.
    ("QWEN4EXP_CPU_GATHER_STREAM_BYTES", INT64_OVER, "<= 9223372036854775807"),
    ("QWEN4EXP_CPU_GATHER_STREAM_BYTES", "9" * 30, "<= 9223372036854775807"),
    ("QWEN4EXP_CPU_FRESH_OUTPUT_CACHE_BYTES", "-1", "must be a byte count >= 0"),  # negative
    ("QWEN4EXP_CPU_FRESH_OUTPUT_CACHE_BYTES", "512M", "must be a byte count >= 0"),  # unit
]


@pytest.mark.parametrize("name,value,message", IMPORT_CASES, ids=lambda v: repr(v)[:24])
def test_a_bad_library_variable_fails_the_import(name, value, message):
    run = python("import qwen4exp_ext", **{name: value})
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: {name} ") and message in last, run.stderr[-2000:]
    assert last.endswith(f"got {value!r}"), last


def test_empty_library_variables_are_their_defaults():
    code = """
        import qwen4exp_ext
        from qwen4exp_ext import ops
        print(qwen4exp_ext.debug_checks_enabled(), ops.cpu_gather_stream_bytes())
    """
    run = python(code, QWEN4EXP_DEBUG_CHECKS="", QWEN4EXP_CPU_GATHER_STREAM_BYTES="")
    assert run.returncode == 0, run.stderr
    # the threshold's default: from this process's cache sizes, as a fresh unset one has it
    from qwen4exp_ext import ops

    previous = ops.set_cpu_gather_stream_bytes(None)
    try:
        assert run.stdout.split() == ["False", str(ops.cpu_gather_stream_bytes())]
    finally:
        ops.set_cpu_gather_stream_bytes(previous)


SIMT_SEED_CASES = [
    ("x", "junk"),
    ("-1", "negative: C's strtoull wraps it to 2**64-1"),
    (str(1 << 64), "overflow: strtoull saturates it"),
    ("010", "a leading zero: strtoull reads it as octal 8"),
    ("1.5", "not an integer"),
    (" 7", "a space"),
]


@pytest.mark.skipif(not simt.available(), reason="built without the SIMT emulator")
@pytest.mark.parametrize("value,why", SIMT_SEED_CASES, ids=[c[0] for c in SIMT_SEED_CASES])
def test_a_bad_simt_seed_fails_the_emulators_load(value, why):
    """Read by the emulator library when it loads (csrc/simt/runtime.cpp), which only printed a
    line for junk and took the others as some other seed."""
    run = python(
        "from qwen4exp_ext import simt; simt.ops(32); print('loaded')", QWEN4EXP_SIMT_SEED=value
    )
    assert run.returncode != 0 and "loaded" not in run.stdout, why
    last = run.stderr.strip().splitlines()[-1]
    assert last == (
        "ValueError: QWEN4EXP_SIMT_SEED must be an integer >= 0 and < 2**64, decimal without a "
        f"leading zero or hex with 0x, got {value!r}"
    )


@pytest.mark.skipif(not simt.available(), reason="built without the SIMT emulator")
def test_good_simt_seeds_load():
    code = "from qwen4exp_ext import simt; simt.ops(64); print('loaded')"
    for value in ("0x1F", "18446744073709551615", ""):
        run = python(code, QWEN4EXP_SIMT_SEED=value)
        assert run.returncode == 0 and run.stdout.split() == ["loaded"], run.stderr


# ---- the vLLM plugin's variables: one warning in vLLM's log and the default -----------------


@pytest.mark.parametrize("value", ["ture", "2", "-1", "enable"])
def test_a_bad_prefetch_switch_is_one_warning_and_on(value, monkeypatch, plugin_warnings):
    monkeypatch.setenv(prefetch.ENV, value)
    with nothing_left_behind():
        assert prefetch.enabled() and prefetch.enabled()  # read every step: warned once
    assert plugin_warnings() == [
        f"qwen4exp_ext vLLM plugin: QWEN4EXP_VLLM_PREFETCH {FLAG_MESSAGE}, any case, got "
        f"{value!r}; using the default, on"
    ]


@pytest.mark.parametrize(
    "value,expected", [("off", False), ("No", False), ("", True), ("  ", True)]
)
def test_the_prefetch_switch_reads_the_flag_words(value, expected, monkeypatch, plugin_warnings):
    monkeypatch.setenv(prefetch.ENV, value)
    assert prefetch.enabled() is expected
    monkeypatch.setenv(prefetch.ENV, "YES")
    assert prefetch.enabled()
    assert plugin_warnings() == []


@pytest.mark.parametrize("value", ["fastest", "1", "our"])
def test_a_bad_kernels_switch_is_one_warning_and_auto(value, monkeypatch, plugin_warnings):
    monkeypatch.setenv(choice.ENV, value)
    chooser = choice.Chooser(cache_path=None)
    assert chooser.mode() == "auto" and chooser.mode() == "auto"
    assert plugin_warnings() == [
        f"qwen4exp_ext vLLM plugin: QWEN4EXP_VLLM_KERNELS={value!r} is not one of "
        "auto|ours|vllm; using auto"
    ]


TABLE_DIR_CASES = {
    # name: (make the value from tmp_path, what the one warning says of it)
    "missing": (lambda p: str(p / "nowhere"), "does not exist"),
    "a file": (lambda p: str(written(p / "ple0.q4xt", b"x")), "is not a directory"),
}


@pytest.mark.parametrize("case", sorted(TABLE_DIR_CASES))
def test_a_bad_table_dir_is_one_warning_and_off(case, tmp_path, monkeypatch, plugin_warnings):
    """``$QWEN4EXP_VLLM_TABLE_DIR`` (vllm/table_dir.py), read at each PLE layer's construction:
    a value that names no directory is one warning naming it, and vLLM's own tables."""
    make, said = TABLE_DIR_CASES[case]
    value = make(tmp_path)
    monkeypatch.setenv(_switches.VLLM_TABLE_DIR_ENV, value)
    with nothing_left_behind(tmp_path):
        assert table_dir.configured_table_dir(None) is None
        assert table_dir.configured_table_dir(None) is None  # every layer: warned once
    assert plugin_warnings() == [
        f"qwen4exp_ext vLLM plugin: QWEN4EXP_VLLM_TABLE_DIR must name an existing directory, "
        f"got {value!r}, which {said}; using the default, off"
    ]


def test_the_table_dir_of_additional_config_comes_first_and_a_bad_one_raises(
    tmp_path, monkeypatch, plugin_warnings
):
    from types import SimpleNamespace

    monkeypatch.setenv(_switches.VLLM_TABLE_DIR_ENV, str(tmp_path / "nowhere"))
    config = SimpleNamespace(additional_config={table_dir.ADDITIONAL_CONFIG_KEY: str(tmp_path)})
    assert table_dir.configured_table_dir(config) == tmp_path
    monkeypatch.setenv(_switches.VLLM_TABLE_DIR_ENV, "")
    assert table_dir.configured_table_dir(SimpleNamespace(additional_config={})) is None
    bad = SimpleNamespace(additional_config={table_dir.ADDITIONAL_CONFIG_KEY: 7})
    with pytest.raises(ValueError, match="'qwen4exp_table_dir' must name an existing directory"):
        table_dir.configured_table_dir(bad)
    assert plugin_warnings() == []


class Timer:
    def __call__(self, op, label, which, setup, call) -> float:
        return 1.0 if which == choice.OURS else 2.0


def decide_under_timeout(chooser: choice.Chooser, unblock=None) -> str:
    """``chooser.decide`` of one CPU class, on a thread joined with a timeout: the unfixed read
    blocked on a FIFO's open. ``unblock()`` frees a stuck thread before the test fails."""
    result: list = []

    def run() -> None:
        try:
            result.append(
                chooser.decide("op", ("x", 8), torch.device("cpu"), lambda: None, None, None)
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.append(exc)

    worker = threading.Thread(target=run, name="decide", daemon=True)
    worker.start()
    worker.join(timeout=30)
    if worker.is_alive():
        if unblock is not None:
            unblock()
        worker.join(timeout=30)
        pytest.fail("decide() blocked on the choice cache")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def chooser_from_env(monkeypatch, value: str) -> choice.Chooser:
    monkeypatch.setenv(choice.CACHE_ENV, value)
    return choice.Chooser(
        timer=Timer(), key=lambda device: {"gpu": "G"}, timed_device_types=frozenset({"cpu"})
    )


def written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def fifo_at(path: Path) -> Path:
    os.mkfifo(path)
    return path


def symlink_loop_at(path: Path) -> Path:
    os.symlink(path, path)
    return path


def file_under_a_file(path: Path) -> Path:
    return written(path, b"x") / "choices.json"


CACHE_PATH_CASES = {
    # name: (make the path from a fresh one in tmp_path, what the one warning says)
    "directory": (lambda p: p.parent, "is not a regular file"),
    "fifo": (fifo_at, "is not a regular file"),
    "under a file": (file_under_a_file, "Not a directory"),
    "symlink loop": (symlink_loop_at, "Too many levels of symbolic links"),
    "too large": (
        lambda p: written(p, b" " * (choice.MAX_CACHE_BYTES + 1)),
        f"is larger than {choice.MAX_CACHE_BYTES} bytes",
    ),
    # Contents that are no valid cache are replaced instead: tests/test_vllm_choice.py.
}


@pytest.mark.parametrize("case", sorted(CACHE_PATH_CASES))
def test_an_unusable_choice_cache_path_is_one_warning_and_left_alone(
    case, tmp_path, monkeypatch, plugin_warnings
):
    """Issue #47 item 7: a FIFO blocked the read for ever. A path that is no regular file, can
    not be read or is too large: decide() still chooses, one warning names the path and the
    variable, and the path is left as it was (nothing written)."""
    make, said = CACHE_PATH_CASES[case]
    path = make(tmp_path / "choices.json")
    before = path.read_bytes() if path.is_file() else None
    chooser = chooser_from_env(monkeypatch, str(path))

    def unblock() -> None:
        """A writer lets a reader stuck in the FIFO's open() through; the FIFO goes, so that
        the next open finds nothing rather than blocking again."""
        writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        path.unlink()
        os.close(writer)

    with nothing_left_behind(tmp_path):
        assert decide_under_timeout(chooser, unblock if case == "fifo" else None) == choice.OURS
        # a second class: timed and chosen, still no file written, no second warning
        got = chooser.decide("op", ("y", 1), torch.device("cpu"), lambda: None, None, None)
        assert got == choice.OURS
    warned = plugin_warnings()
    assert len(warned) == 1 and str(path) in warned[0] and said in warned[0], warned
    assert warned[0].endswith(f"({choice.CACHE_ENV})")
    if before is not None:
        assert path.read_bytes() == before


def test_dev_zero_as_the_choice_cache_is_refused_without_reading():
    """Issue #47 item 7: /dev/zero read without end (memory without bound). In a fresh
    interpreter with its address space capped, so that the unfixed read fails fast."""
    code = """
        import logging, resource, torch
        from qwen4exp_ext.vllm import choice
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        with open("/proc/self/status") as f:
            size = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
        chooser = choice.Chooser(
            timer=lambda op, label, which, setup, call: 1.0 if which == "ours" else 2.0,
            key=lambda device: {"gpu": "G"},
            timed_device_types=frozenset({"cpu"}),
        )
        print(chooser.decide("op", ("x", 8), torch.device("cpu"), None, None, None))
    """
    run = python(code, QWEN4EXP_VLLM_CHOICE_CACHE="/dev/zero")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["ours"]
    warned = [line for line in run.stderr.splitlines() if line.startswith("WARNING")]
    assert warned == [
        "WARNING qwen4exp_ext vLLM plugin: cannot read the kernel-choice cache /dev/zero: "
        "/dev/zero is not a regular file; not used (QWEN4EXP_VLLM_CHOICE_CACHE)"
    ]
    assert Path("/dev/zero").is_char_device()


def test_a_missing_choice_cache_and_folder_are_made_without_a_warning(
    tmp_path, monkeypatch, plugin_warnings
):
    path = tmp_path / "new" / "folder" / "choices.json"
    chooser = chooser_from_env(monkeypatch, str(path))
    assert decide_under_timeout(chooser) == choice.OURS
    assert plugin_warnings() == []
    assert json.loads(path.read_text())["choices"]["op | x T<=8"]["chosen"] == "ours"


@pytest.mark.parametrize("value", ["0", "off", "False", "NO", " 0 "])
def test_an_off_word_means_no_choice_cache(value, monkeypatch):
    monkeypatch.setenv(choice.CACHE_ENV, value)
    assert choice.default_cache_path() is None


@pytest.mark.parametrize("value", ["1", "on", "True", "yes", "", " "])
def test_an_on_word_or_empty_means_the_default_choice_cache(value, tmp_path, monkeypatch):
    """Not a file named "1" in whatever folder vLLM was started from."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(choice.CACHE_ENV, value)
    assert choice.default_cache_path() == tmp_path / "qwen4exp_ext" / "vllm_kernel_choices.json"


# ---- the bench's variables: a ValueError naming the variable ---------------------------------

CPU = torch.device("cpu")
MIN_ROWS = step_proxy.NUM_HEADS * (step_proxy.PAD_TO + 1)
BENCH_COUNT_CASES = [
    # (variable, read by, value, message)
    *(
        ("QWEN4EXP_BENCH_GATHER_ROWS", lambda: gather_rows.table_rows(CPU), value, message)
        for value, message in [
            ("x", "must be a row count >= 1"),  # junk
            ("-1", "must be a row count >= 1"),  # negative
            ("0", "must be a row count >= 1"),  # below the range
            ("4e6", "must be a row count >= 1"),  # exponent
            (INT64_OVER, "<= 9223372036854775807"),  # overflow
        ]
    ),
    *(
        ("QWEN4EXP_BENCH_HOST_LOOKUP_ROWS", lambda: step_proxy.size_for(CPU), value, message)
        for value, message in [
            ("x", f"must be a row count >= {MIN_ROWS}"),
            ("-5", f"must be a row count >= {MIN_ROWS}"),
            (str(MIN_ROWS - 1), f"must be a row count >= {MIN_ROWS}"),
            ("1_000", f"must be a row count >= {MIN_ROWS}"),
            (INT64_OVER, "<= 9223372036854775807"),
        ]
    ),
]


@pytest.mark.parametrize(
    "name,read,value,message",
    BENCH_COUNT_CASES,
    ids=[f"{c[0].removeprefix('QWEN4EXP_BENCH_')}={c[2][:12]}" for c in BENCH_COUNT_CASES],
)
def test_a_bad_bench_count(name, read, value, message, monkeypatch):
    monkeypatch.setenv(name, value)
    with nothing_left_behind(), pytest.raises(ValueError) as error:
        read()
    assert str(error.value).startswith(f"{name} ") and message in str(error.value)
    assert str(error.value).endswith(f"got {value!r}")


def test_empty_bench_counts_are_their_defaults(monkeypatch):
    monkeypatch.setenv("QWEN4EXP_BENCH_GATHER_ROWS", "")
    monkeypatch.setenv(step_proxy.ROWS_ENV, "")
    monkeypatch.setenv(step_proxy.SIZE_ENV, "")
    assert gather_rows.table_rows(CPU) == 4_000_000
    assert step_proxy.size_for(CPU) == step_proxy.SIZES["cpu"]
    monkeypatch.setenv(step_proxy.ROWS_ENV, str(MIN_ROWS))
    assert step_proxy.size_for(CPU).rows == MIN_ROWS


@pytest.mark.parametrize("value", ["huge", "Quick", "1"])
def test_a_bad_host_lookup_size(value, monkeypatch):
    monkeypatch.setenv(step_proxy.SIZE_ENV, value)
    with pytest.raises(ValueError) as error:
        step_proxy.size_for(CPU)
    assert str(error.value) == (
        f"$QWEN4EXP_BENCH_HOST_LOOKUP_SIZE={value!r}: choose one of released, cpu, quick"
    )


@pytest.mark.parametrize("value", ["ture", "2", "-1"])
def test_a_bad_vllm_interpret_switch(value, monkeypatch):
    """Only "1" meant on: "true" and "yes" were silently off."""
    monkeypatch.setenv(registry.VLLM_INTERPRET_ENV, value)
    with pytest.raises(ValueError) as error:
        registry.vllm_kernels(CPU)
    assert str(error.value) == (
        f"QWEN4EXP_BENCH_VLLM_INTERPRET {FLAG_MESSAGE}, any case, got {value!r}"
    )
    monkeypatch.setenv(registry.VLLM_INTERPRET_ENV, "no")
    assert registry.vllm_kernels(CPU).note == registry.VLLM_CPU_NOTE


def folder_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """The kinds of path that are no folder, and what the error says of each."""
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    return {
        "missing": (tmp_path / "missing", "does not exist"),
        "file": (tmp_path / "file", "is not a directory"),
        "fifo": (tmp_path / "fifo", "is not a directory"),
        "under a file": (tmp_path / "file" / "d", "does not exist"),
    }


@pytest.mark.parametrize("kind", ["missing", "file", "fifo", "under a file"])
def test_a_bench_table_dir_that_is_no_folder(kind, tmp_path, monkeypatch):
    path, what = folder_cases(tmp_path)[kind]
    monkeypatch.setenv(staged_lookup.TABLE_DIR_ENV, str(path))
    with nothing_left_behind(tmp_path), pytest.raises(ValueError) as error:
        staged_lookup._table_dir()
    assert str(error.value) == (
        f"QWEN4EXP_BENCH_TABLE_DIR must name an existing directory, got {str(path)!r}, which {what}"
    )


def test_the_bench_table_dir_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv(staged_lookup.TABLE_DIR_ENV, str(tmp_path))
    made = Path(staged_lookup._table_dir())
    assert made.parent == tmp_path and made.is_dir()
    made.rmdir()


@pytest.mark.parametrize("kind", ["missing", "file", "fifo", "under a file"])
def test_a_vllm_source_that_is_no_folder(kind, tmp_path, monkeypatch):
    """It fell back to the installed vLLM, silently: a bench said it ran a source it did not."""
    path, what = folder_cases(tmp_path)[kind]
    monkeypatch.setenv(vllm_triton.SOURCE_ENV, str(path))
    with nothing_left_behind(tmp_path), pytest.raises(ValueError) as error:
        vllm_triton.ple_source_path()
    assert str(error.value) == (
        f"QWEN4EXP_VLLM_SOURCE must name an existing directory, got {str(path)!r}, which {what}"
    )


def test_a_vllm_source_folder_not_written_by_the_extractor(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_triton.SOURCE_ENV, str(tmp_path))
    with pytest.raises(ValueError) as error:
        vllm_triton.ple_source_path()
    assert str(error.value) == (
        "QWEN4EXP_VLLM_SOURCE must name a folder written by `python -m qwen4exp_ext.bench."
        f"vllm_triton DIR`, got {str(tmp_path)!r}, which holds no VLLM_VERSION"
    )
