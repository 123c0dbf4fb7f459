"""The vLLM plugin's measured choice between our kernels and vLLM's own
(python/qwen4exp_ext/vllm/choice.py), on the CPU with an injected timer: the choice follows the
timer and a tie goes to vLLM's, the state after a timed first call equals an untimed call's, the
table is logged once, persisted choices are used and invalidated by any key field, the
``QWEN4EXP_VLLM_KERNELS`` switch, and nothing is timed under capture or torch.compile tracing.

vLLM's kernels are vLLM 0.33.0's own code: its Triton kernels run on the CPU under Triton's
interpreter (loaded by :mod:`qwen4exp_ext.bench.vllm_triton`), handed to the plugin's
replacement factories as "vLLM's original"; so are vLLM's own lookup methods. No test here
loads the plugin (test_vllm_plugin.py's fixture must see vLLM unpatched)."""

from __future__ import annotations

import json
import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch

from ple_conv.support import make_batch
from qwen4exp_ext import ops
from qwen4exp_ext.bench import vllm_triton
from qwen4exp_ext.testing import assert_exact
from qwen4exp_ext.vllm import choice, shims
from vllm_support import recorded_ops, require_vllm

pytestmark = require_vllm()

VLLM = vllm_triton.load()
EPS = 1e-6
KEY = {"gpu": "G", "driver": "d1", "torch": "t1", "vllm": "v1", "qwen4exp_ext": "q1"}


class FakeTimer:
    """Returns the given µs per kernel; with ``run``, also runs each kernel ``run`` times on
    fresh ``setup()`` arguments, as the event timer does."""

    def __init__(self, ours: float, vllm: float, run: int = 0) -> None:
        self.us = {choice.OURS: ours, choice.VLLM: vllm}
        self.run = run
        self.calls: list[tuple[str, str, str]] = []

    def __call__(self, op, label, which, setup, call) -> float:
        self.calls.append((op, label, which))
        for _ in range(self.run):
            call(setup())
        return self.us[which]


def no_timer(*args):
    raise AssertionError(f"timed {args[:3]} though nothing may be timed")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A fresh process-wide chooser that times CPU kernels, its cache file in tmp_path; the
    default one again after the test."""
    monkeypatch.delenv(choice.ENV, raising=False)

    def make(timer=no_timer, *, key=None, cache=tmp_path / "choices.json", cpu=True):
        return choice.reset(
            timer=timer,
            key=key or (lambda device: dict(KEY)),
            cache_path=cache,
            timed_device_types=frozenset({"cpu", "cuda"} if cpu else {"cuda"}),
        )

    yield make
    monkeypatch.delenv(choice.ENV, raising=False)
    choice.reset()


class Counted:
    """vLLM's kernel (under the interpreter), counting its calls."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        with vllm_triton.interpreter():
            return self.fn(*args, **kwargs)


def gate_args(tokens: int, dtype=torch.float16, seed: int = 3):
    """ple_gate's arguments (fp16: under the interpreter vLLM's bf16 rounding is not its GPU
    kernel's, see tests/ple_gate/test_kernel.py; fp16 is bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    m, h = 3, 40
    kv = torch.randn(tokens, m * h + h, generator=g).to(dtype)
    key, value = kv.split([m * h, h], dim=-1)
    hidden = torch.randn(tokens, m * h, generator=g).to(dtype)
    w = [0.1 * torch.randn(m * h, generator=g).to(dtype) for _ in range(3)]
    return (key, value, hidden, *w, EPS)


def ours_ran(names, op="qwen4exp::ple_gate") -> int:
    return sum(1 for n in names if n == op)


def test_token_buckets():
    got = [choice.token_bucket(t) for t in (0, 1, 2, 3, 4, 5, 16, 17, 512, 8192, 8193, 10**6)]
    assert got == [1, 1, 2, 4, 4, 8, 16, 32, 512, 8192, 8193, 8193]
    assert choice.class_label((torch.bfloat16, 40, 8193)) == "bfloat16 40 T>8192"
    assert choice.class_label(("decode", "SD", 16)) == "decode SD T<=16"


# ---- the choice follows the timer ---------------------------------------------------------


@pytest.mark.parametrize(
    "ours_us,vllm_us,expected",
    [(1.0, 2.0, "ours"), (2.0, 1.0, "vllm"), (1.5, 1.5, "vllm")],
    ids=["ours-faster", "vllm-faster", "tie-to-vllm"],
)
def test_the_choice_follows_the_timer_and_a_tie_goes_to_vllm(fresh, ours_us, vllm_us, expected):
    timer = FakeTimer(ours_us, vllm_us)
    chooser = fresh(timer)
    vllm_gate = Counted(VLLM.ple_gate)
    gate = shims._make_ple_gate(vllm_gate)
    args = gate_args(5)
    for _ in range(3):
        with recorded_ops() as names:
            got = gate(*args)
        ran_ours = ours_ran(names)
        assert (ran_ours, vllm_gate.calls) == ((1, 0) if expected == "ours" else (0, 1))
        vllm_gate.calls = 0
        torch.testing.assert_close(got, ops.ple_gate(*args), rtol=0, atol=0)  # same contract
    # timed once, both kernels, the class named by dtype, widths and token bucket
    assert timer.calls == [
        ("ple_gate", "float16 40 120 T<=8", "ours"),
        ("ple_gate", "float16 40 120 T<=8", "vllm"),
    ]
    (made,) = chooser.choices.values()
    assert (made.chosen, made.ours_us, made.vllm_us) == (expected, ours_us, vllm_us)


def test_each_shape_class_is_timed_once(fresh):
    timer = FakeTimer(1.0, 2.0)
    fresh(timer)
    gate = shims._make_ple_gate(Counted(VLLM.ple_gate))
    for tokens in (1, 5, 7, 8, 9, 300, 5, 1):
        gate(*gate_args(tokens))
    gate(*gate_args(5, dtype=torch.bfloat16))
    labels = [label for _, label, which in timer.calls if which == "ours"]
    assert labels == [
        "float16 40 120 T<=1",
        "float16 40 120 T<=8",
        "float16 40 120 T<=16",
        "float16 40 120 T<=512",
        "bfloat16 40 120 T<=8",
    ]


def test_a_kernel_that_cannot_run_loses(fresh):
    """The event timer counts a kernel that raises as infinitely slow; both raising is a tie."""

    def raises(_):
        raise RuntimeError("no kernel for this")

    assert choice.event_timer("op", "c", "vllm", tuple, raises) == float("inf")
    assert choice.event_timer("op", "c", "ours", tuple, lambda a: None) < float("inf")


# ---- state: timed on copies ---------------------------------------------------------------


@pytest.mark.parametrize("chosen", ["ours", "vllm"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("window_first", [True, False])
def test_state_after_a_timed_first_call_equals_an_untimed_call(fresh, chosen, mode, window_first):
    """Both kernels run three times each (plus nothing else) on copies; the live residual and
    conv_state then hold exactly one call of the chosen kernel."""
    timer = FakeTimer(1.0 if chosen == "ours" else 3.0, 2.0, run=3)
    fresh(timer)
    vllm_conv = Counted(VLLM.ple_conv)
    conv = shims._make_ple_conv(vllm_conv)
    lengths = [3, 1, 0, 4] if mode == "prefill" else None
    batch = make_batch(mode, torch.float16, lengths=lengths, window_first=window_first)
    untimed = Counted(VLLM.ple_conv) if chosen == "vllm" else ops.ple_conv
    expected = batch.run(untimed)
    got = batch.run(conv)
    assert vllm_conv.calls == 3 + (chosen == "vllm")
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    # the timing copies kept the state's layout
    layout = "SD" if window_first else "DS"
    assert timer.calls[0][1].startswith(f"{mode} {layout} float16 37 4 3 fused - T<=")


def test_ngram_ids_into_an_output_is_timed_into_copies(fresh):
    from test_vllm_plugin import _toy_case

    timer = FakeTimer(1.0, 2.0, run=2)
    fresh(timer)
    seen: list[torch.Tensor] = []

    def original(*args):
        seen.append(args[-1])
        with vllm_triton.interpreter():
            return VLLM.ple_ngram_ids(*args)

    ngram_ids = shims._make_ple_ngram_ids(original)
    args = _toy_case()
    expected = ops.ngram_ids(*args)
    out = torch.full_like(expected, -1)
    assert ngram_ids(*args, out) is out
    assert torch.equal(out, expected)
    assert len(seen) == 2 and all(o is not out for o in seen)


# ---- the log ------------------------------------------------------------------------------


@pytest.fixture
def vllm_log():
    records: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("vllm.qwen4exp_ext")
    handler, level = Handler(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield records
    log.removeHandler(handler)
    log.setLevel(level)


def test_the_table_is_logged_once(fresh, vllm_log):
    fresh(FakeTimer(1.0, 2.0))
    gate = shims._make_ple_gate(Counted(VLLM.ple_gate))
    gate(*gate_args(1))
    gate(*gate_args(100))
    assert vllm_log == []  # still warming up
    for _ in range(3):
        gate(*gate_args(1))
        gate(*gate_args(100))
    tables = [r for r in vllm_log if "kernel choices" in r]
    assert len(tables) == 1 and len(vllm_log) == 1
    lines = tables[0].splitlines()
    assert lines[1].split() == ["op", "class", "ours", "µs", "vLLM", "µs", "chosen"]
    assert lines[2].split() == ["ple_gate", "float16", "40", "120", "T<=1", "1.00", "2.00", "ours"]
    assert "T<=128" in lines[3] and len(lines) == 4
    gate(*gate_args(1000))  # a class after the table: one line
    assert len(vllm_log) == 2 and "choice added" in vllm_log[1] and "T<=1024" in vllm_log[1]
    gate(*gate_args(1000))
    assert len(vllm_log) == 2


# ---- persistence ----------------------------------------------------------------------------


def test_persisted_choices_are_used_without_timing(fresh, tmp_path, vllm_log):
    path = tmp_path / "choices.json"
    fresh(FakeTimer(2.0, 1.0))
    vllm_gate = Counted(VLLM.ple_gate)
    gate = shims._make_ple_gate(vllm_gate)
    gate(*gate_args(5))
    saved = json.loads(path.read_text())
    assert saved["key"] == KEY
    assert saved["choices"] == {
        "ple_gate | float16 40 120 T<=8": {
            "op": "ple_gate",
            "label": "float16 40 120 T<=8",
            "ours_us": 2.0,
            "vllm_us": 1.0,
            "chosen": "vllm",
        }
    }
    assert sorted(os.listdir(tmp_path)) == ["choices.json"]  # no temporary left behind

    fresh(no_timer)  # a later process with the same key
    vllm_gate.calls = 0
    gate(*gate_args(6))
    gate(*gate_args(7))
    assert vllm_gate.calls == 2
    assert "vllm (cached)" in vllm_log[-1]


@pytest.mark.parametrize("field", sorted(KEY))
def test_a_changed_key_field_invalidates_the_persisted_choices(fresh, tmp_path, field):
    path = tmp_path / "choices.json"
    fresh(FakeTimer(2.0, 1.0))
    gate = shims._make_ple_gate(Counted(VLLM.ple_gate))
    gate(*gate_args(5))
    changed = {**KEY, field: KEY[field] + "-new"}
    timer = FakeTimer(1.0, 2.0)
    chooser = fresh(timer, key=lambda device: dict(changed))
    with recorded_ops() as names:
        gate(*gate_args(5))
    assert len(timer.calls) == 2 and ours_ran(names) == 1
    assert next(iter(chooser.choices.values())).source == "timed"
    saved = json.loads(path.read_text())
    assert saved["key"] == changed
    assert [c["chosen"] for c in saved["choices"].values()] == ["ours"]


def test_saving_merges_what_another_process_saved(fresh, tmp_path):
    fresh(FakeTimer(1.0, 2.0))
    gate = shims._make_ple_gate(Counted(VLLM.ple_gate))
    gate(*gate_args(5))
    fresh(FakeTimer(1.0, 2.0))  # another process, same key, another class
    gate(*gate_args(100))
    saved = json.loads((tmp_path / "choices.json").read_text())
    assert sorted(saved["choices"]) == [
        "ple_gate | float16 40 120 T<=128",
        "ple_gate | float16 40 120 T<=8",
    ]


def test_no_cache_file_when_switched_off(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv(choice.CACHE_ENV, "0")
    assert choice.default_cache_path() is None
    monkeypatch.setenv(choice.CACHE_ENV, str(tmp_path / "x.json"))
    assert choice.default_cache_path() == tmp_path / "x.json"
    monkeypatch.delenv(choice.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert choice.default_cache_path() == tmp_path / "qwen4exp_ext" / "vllm_kernel_choices.json"
    fresh(FakeTimer(1.0, 2.0), cache=None)
    shims._make_ple_gate(Counted(VLLM.ple_gate))(*gate_args(5))
    assert os.listdir(tmp_path) == []


# ---- a cache that cannot be used (issue #47 item 10) -----------------------------------------

CLASS_KEY = "op | x T<=8"  # the entry decide("op", ("x", 8), ...) looks up
GOOD_ENTRY = {"op": "op", "label": "x T<=8", "ours_us": 2.0, "vllm_us": 1.0, "chosen": "vllm"}


def cache_text(**fields) -> str:
    """A cache of KEY whose fields are replaced by ``fields`` (Python values, as json.dumps
    writes them, NaN and Infinity included)."""
    return json.dumps({"format": 1, "key": KEY, "choices": {}, **fields})


DEEP = 100_000
BAD_CACHES = {
    # name: (the file's text, what the one warning says)
    "choices a list": (cache_text(choices=[GOOD_ENTRY]), "its choices are a list"),
    "choices a string": (cache_text(choices="ours"), "its choices are a str"),
    "choices null": (cache_text(choices=None), "its choices are a NoneType"),
    "no choices": (json.dumps({"format": 1, "key": KEY}), "its choices are a NoneType"),
    "entry a list": (cache_text(choices={CLASS_KEY: [1]}), f"its choice {CLASS_KEY!r} is not"),
    "entry a string": (cache_text(choices={CLASS_KEY: "ours"}), f"its choice {CLASS_KEY!r}"),
    "entry null": (cache_text(choices={CLASS_KEY: None}), f"its choice {CLASS_KEY!r} is not"),
    "chosen unknown": (
        cache_text(choices={CLASS_KEY: {**GOOD_ENTRY, "chosen": "fastest"}}),
        f"its choice {CLASS_KEY!r} is not",
    ),
    "chosen a list": (
        cache_text(choices={CLASS_KEY: {**GOOD_ENTRY, "chosen": ["ours"]}}),
        f"its choice {CLASS_KEY!r} is not",
    ),
    "time a string": (
        cache_text(choices={CLASS_KEY: {**GOOD_ENTRY, "ours_us": "2.0"}}),
        f"its choice {CLASS_KEY!r} is not",
    ),
    "time true": (
        cache_text(choices={CLASS_KEY: {**GOOD_ENTRY, "vllm_us": True}}),
        f"its choice {CLASS_KEY!r} is not",
    ),
    # NaN and the infinities load, but json.dump(allow_nan=False) refuses them: every later
    # save failed, and was said at DEBUG only.
    "time NaN": (
        cache_text(choices={"other | T<=1": {**GOOD_ENTRY, "ours_us": math.nan}}),
        "its choice 'other | T<=1' is not",
    ),
    "time Infinity": (
        cache_text(choices={"other | T<=1": {**GOOD_ENTRY, "vllm_us": -math.inf}}),
        "its choice 'other | T<=1' is not",
    ),
    "time 1e400": (  # json reads it as inf
        cache_text(choices={"o": {**GOOD_ENTRY, "ours_us": 1.0}}).replace("1.0", "1e400"),
        "its choice 'o' is not",
    ),
    "time 10**400": (
        cache_text(choices={"o": {**GOOD_ENTRY, "ours_us": 10**400}}),
        "its choice 'o' is not",
    ),
    "format 1.0": (cache_text(format=1.0), "its format is 1.0, not 1"),
    "format true": (cache_text(format=True), "its format is True, not 1"),
    "format 2": (cache_text(format=2), "its format is 2, not 1"),
    "format '1'": (cache_text(format="1"), "its format is '1', not 1"),
    "key a list": (cache_text(key=[1]), "its key is not an object of strings"),
    "a JSON list": ("[1, 2]", "it is a JSON list, not an object"),
    "deep nesting": (
        cache_text(choices=None).replace("null", "[" * DEEP + "]" * DEEP),
        "it is no JSON (RecursionError",
    ),
    "not JSON": ("my notes\n", "it is no JSON (JSONDecodeError"),
    "not UTF-8": ('{"format": 1, "x": "\xff"}', "it is no JSON (UnicodeDecodeError"),
}


@pytest.fixture
def plugin_warnings(caplog):
    """The plugin's warnings so far (its logger's records reach caplog through a handler put
    on it, each once: vLLM's loggers may not propagate)."""
    log = logging.getLogger("vllm.qwen4exp_ext")
    propagate, log.propagate = log.propagate, False
    log.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger=log.name)
    yield lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    log.removeHandler(caplog.handler)
    log.propagate = propagate


def strict_json(text: str):
    """json.loads that refuses NaN and the infinities, as a valid cache has none."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the cache"))


@pytest.mark.parametrize("case", list(BAD_CACHES))
def test_a_bad_cache_is_ignored_with_one_warning_and_replaced(
    case, fresh, tmp_path, plugin_warnings
):
    """Issue #47 item 10: wrong-typed choices made decide() raise (in vLLM, on the first eager
    call of every swapped op), format 1.0 or true passed, NaN made every later save fail, and
    a dropped cache was said at DEBUG only. decide() must choose, say it once at WARNING, and
    the next save must write a valid cache that a later process uses."""
    text, said = BAD_CACHES[case]
    path = tmp_path / "choices.json"
    path.write_bytes(text.encode("latin-1") if case == "not UTF-8" else text.encode())
    chooser = fresh(FakeTimer(1.0, 2.0))
    cpu = torch.device("cpu")
    assert chooser.decide("op", ("x", 8), cpu, lambda: None, None, None) == "ours"
    assert chooser.decide("op", ("y", 1), cpu, lambda: None, None, None) == "ours"
    warned = plugin_warnings()
    assert len(warned) == 1, warned
    assert str(path) in warned[0] and said in warned[0], warned[0]
    assert warned[0].endswith("it is replaced at the next save (QWEN4EXP_VLLM_CHOICE_CACHE)")
    saved = strict_json(path.read_text())
    assert saved["format"] == 1 and saved["key"] == KEY
    assert sorted(saved["choices"]) == ["op | x T<=8", "op | y T<=1"]
    assert saved["choices"][CLASS_KEY]["chosen"] == "ours"
    assert sorted(os.listdir(tmp_path)) == ["choices.json"]  # no temporary left behind
    later = fresh(no_timer)  # a later process: the saved choices, untimed, nothing said
    assert later.decide("op", ("x", 8), cpu, lambda: None, None, None) == "ours"
    assert len(plugin_warnings()) == 1


def test_another_process_entrys_extra_fields_never_reach_the_file(fresh, tmp_path):
    """A valid cache whose entry carries more than its fields (a NaN, deep nesting): the
    entry is used and merged, with its fields only, and the save succeeds."""
    path = tmp_path / "choices.json"
    extra = {**GOOD_ENTRY, "note": math.nan, "deep": [[[[1]]]]}
    path.write_text(cache_text(choices={CLASS_KEY: extra}))
    chooser = fresh(FakeTimer(1.0, 2.0))
    cpu = torch.device("cpu")
    assert chooser.decide("op", ("x", 8), cpu, lambda: None, None, None) == "vllm"  # cached
    assert chooser.decide("op", ("y", 1), cpu, lambda: None, None, None) == "ours"  # timed
    saved = strict_json(path.read_text())
    assert saved["choices"][CLASS_KEY] == GOOD_ENTRY


@pytest.mark.parametrize("measured", [math.nan, math.inf, 10**400], ids=["nan", "inf", "10**400"])
def test_a_measurement_that_is_no_finite_float_is_saved_as_null(measured, fresh, tmp_path):
    """A timer's NaN or infinity (or an int past float's range, which made math.isfinite raise)
    never reaches the JSON: null, as for a kernel that could not run."""
    chooser = fresh(FakeTimer(measured, 1.0))
    cpu = torch.device("cpu")
    assert chooser.decide("op", ("x", 8), cpu, lambda: None, None, None) == "vllm"
    saved = strict_json((tmp_path / "choices.json").read_text())
    assert saved["choices"][CLASS_KEY]["ours_us"] is None
    assert saved["choices"][CLASS_KEY]["vllm_us"] == 1.0


# ---- the switch ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,expected", [("ours", "ours"), ("vllm", "vllm"), ("VLLM", "vllm"), (None, "ours")]
)
def test_the_environment_switch(fresh, monkeypatch, value, expected):
    """ours/vllm: every call, no timing; unset on the CPU (nothing timed there): ours."""
    if value is not None:
        monkeypatch.setenv(choice.ENV, value)
    fresh(no_timer, cpu=value is not None)
    vllm_gate = Counted(VLLM.ple_gate)
    gate = shims._make_ple_gate(vllm_gate)
    with recorded_ops() as names:
        gate(*gate_args(5))
    assert (ours_ran(names), vllm_gate.calls) == ((1, 0) if expected == "ours" else (0, 1))
    monkeypatch.setenv(choice.ENV, "ours" if expected == "vllm" else "vllm")  # read once
    gate(*gate_args(5))
    assert vllm_gate.calls == (expected == "vllm") * 2


def test_auto_and_a_bad_value(fresh, monkeypatch, vllm_log):
    monkeypatch.setenv(choice.ENV, "fastest")
    timer = FakeTimer(1.0, 2.0)
    chooser = fresh(timer)
    assert chooser.mode() == "auto"
    assert any("QWEN4EXP_VLLM_KERNELS='fastest'" in r for r in vllm_log)
    monkeypatch.setenv(choice.ENV, "auto")
    fresh(timer).mode()
    shims._make_ple_gate(Counted(VLLM.ple_gate))(*gate_args(5))
    assert len(timer.calls) == 2


# ---- nothing timed during capture or tracing ------------------------------------------------

CUDA = torch.device("cuda")


def test_nothing_is_timed_during_capture(fresh, monkeypatch):
    chooser = fresh(no_timer)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert chooser.choose("ple_gate", ("x", 8), CUDA) == "vllm"  # unseen: vLLM's
    assert chooser.choices == {}  # and nothing recorded: eager calls will still measure
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    chooser.timer = FakeTimer(1.0, 2.0)
    assert chooser.choose("ple_gate", ("x", 8), CUDA) is None
    chooser.decide("ple_gate", ("x", 8), CUDA, tuple, print, print)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    chooser.timer = no_timer
    assert chooser.choose("ple_gate", ("x", 8), CUDA) == "ours"  # the warm-up's choice


def test_nothing_is_timed_under_torch_compile_tracing(fresh, monkeypatch):
    chooser = fresh(no_timer)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    vllm_gate = Counted(VLLM.ple_gate)
    shims._make_ple_gate(vllm_gate)(*gate_args(5))
    assert vllm_gate.calls == 1 and chooser.choices == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA graph capture)")
def test_nothing_is_timed_in_a_real_capture(fresh):
    if "cuda" not in shims.DEVICE_TYPES:
        pytest.skip("this build has no GPU kernels")
    chooser = fresh(no_timer)
    calls = []

    def original(*args):
        calls.append(1)
        return ops.ple_gate(*args)  # stands in for vLLM's, so that capture needs no Triton

    gate = shims._make_ple_gate(original)
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in gate_args(5))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        gate(*args)
    assert calls == [1] and chooser.choices == {}


# ---- lookups: vLLM's own methods ------------------------------------------------------------


def _vllms(fn):
    """vLLM's own method (behind our replacement where the plugin is loaded in this process)."""
    return getattr(fn, shims.MARK, fn)


@pytest.mark.parametrize("chosen", ["ours", "vllm"])
def test_device_table_lookup_choice(fresh, chosen):
    """The device-table lookup of vLLM's unquantized and FP8 methods (real vLLM 0.33.0 code,
    wrapped by the plugin's replacement factory without loading the plugin here)."""
    import vllm.models.qwen4_exp.common.ngram_embedding as ne

    from test_vllm_plugin import _fp8_layer

    fresh(FakeTimer(1.0 if chosen == "ours" else 3.0, 2.0, run=2))
    g = torch.Generator().manual_seed(5)
    table = torch.randn(300, 24, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 300, (9, 4), generator=g)
    method = ne.Qwen4ExpPLEUnquantizedEmbeddingMethod()
    embedding = shims._make_embedding(_vllms(ne.Qwen4ExpPLEEmbeddingMethod.embedding))
    got = embedding(method, SimpleNamespace(weight=table), ids)  # timed: both kernels ran
    assert torch.equal(got, torch.nn.functional.embedding(ids, table))
    with recorded_ops() as names:
        embedding(method, SimpleNamespace(weight=table), ids)
    assert ("qwen4exp::gather_rows" in names) == (chosen == "ours")

    # FP8: vLLM's byte lookup then its own dequantisation, or our fused gather: the same bits
    # (test_vllm_plugin.py's test_fp8_table_lookups_run_ours_dequantised)
    fp8 = ne.Qwen4ExpPLEFp8EmbeddingMethod()
    layer = _fp8_layer(50, 16, gen=g)
    ids = torch.randint(0, 50, (7, 2), generator=g)
    got = embedding(fp8, layer, ids)
    expected = ops.gather_rows(
        layer.weight, ids.reshape(-1, 1), scale=layer.weight_scale, out_dtype=torch.bfloat16
    ).view(7, 2, 16)
    assert got.dtype == torch.bfloat16
    assert_exact(got, expected, bitwise=True, equal_nan=True)  # NaN payloads differ (see there)
    labels = {c.label: c.chosen for c in choice.chooser().choices.values()}
    assert labels == {
        "bfloat16 bfloat16 24 T<=64": chosen,
        "float8_e4m3fn bfloat16 16 T<=16": chosen,
    }
