"""The run-time switches (python/qwen4exp_ext/_switches.py; in C++ csrc/torch/switches.h and the CPU
gather's own): the debug checks and the CPU gather's streaming threshold are read from the
environment once, at import, and set through functions afterwards; the debug-check block holds
for its thread, never writes os.environ, and reaches the C++ glue of every op library (seen
through the emulator's ops, which raise on a bad head size only with the checks on)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import qwen4exp_ext
from conftest import backends
from qwen4exp_ext import layout, ops

DEVICE_INDEX_BACKENDS = [b for b in backends() if b.reads_indices_on_device]
HEADS = layout.head_vocab_layout(50, 4, 1, 16)  # 4 heads = (N-1)=2 x heads_per_ngram=2


def hash_with_a_zero_head_size(kernel_ops) -> None:
    """An ngram_ids call whose third head has size 0: the CPU and the debug checks reject it, a
    GPU kernel gives that head id -1."""
    sizes = torch.tensor(HEADS.sizes)
    sizes[2] = 0
    kernel_ops.ngram_ids(
        torch.tensor([9, 5, 3, 11]),
        torch.tensor([0, 4], dtype=torch.int32),
        torch.tensor([[5, 5]]),
        torch.tensor(layout.layer_multipliers(97, 3, 7, 1)),
        sizes,
        torch.tensor(HEADS.offsets),
        eos_token_id=5,
        heads_per_ngram=2,
    )


def checks_raise(kernel_ops) -> bool:
    try:
        hash_with_a_zero_head_size(kernel_ops)
    except RuntimeError as error:
        assert "ngram_heads_vocab_sizes[2] must be positive" in str(error)
        return True
    return False


def on_another_thread(fn):
    result = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    return result[0]


@pytest.fixture
def checks_off_for_the_process():
    qwen4exp_ext.set_debug_checks(False)
    yield
    qwen4exp_ext.set_debug_checks(False)


@pytest.mark.parametrize("backend", DEVICE_INDEX_BACKENDS, ids=str)
def test_debug_check_blocks_nest_and_hold_for_their_thread(backend, checks_off_for_the_process):
    environ = dict(os.environ)
    assert not checks_raise(backend.ops)
    with qwen4exp_ext.debug_checks():
        assert qwen4exp_ext.debug_checks_enabled() and checks_raise(backend.ops)
        # Another thread has no block, so the process setting (off) holds there.
        assert not on_another_thread(lambda: checks_raise(backend.ops))
        with qwen4exp_ext.debug_checks(enabled=False):
            assert not qwen4exp_ext.debug_checks_enabled() and not checks_raise(backend.ops)
        assert checks_raise(backend.ops)
    assert not qwen4exp_ext.debug_checks_enabled() and not checks_raise(backend.ops)
    assert dict(os.environ) == environ


@pytest.mark.parametrize("backend", DEVICE_INDEX_BACKENDS, ids=str)
def test_set_debug_checks_holds_for_every_thread(backend, checks_off_for_the_process):
    qwen4exp_ext.set_debug_checks(True)
    assert checks_raise(backend.ops)
    assert on_another_thread(lambda: checks_raise(backend.ops))
    with qwen4exp_ext.debug_checks(enabled=False):  # a thread's block wins over the process
        assert not checks_raise(backend.ops)
        assert on_another_thread(lambda: checks_raise(backend.ops))
    qwen4exp_ext.set_debug_checks(False)
    assert not checks_raise(backend.ops)


def test_the_cpu_rejects_bad_values_whatever_the_switch(checks_off_for_the_process):
    assert checks_raise(ops)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_environment_is_read_once_at_import():
    code = """
import os
import qwen4exp_ext
from qwen4exp_ext import ops
print(qwen4exp_ext.debug_checks_enabled(), ops.cpu_gather_stream_bytes(),
      ops.cpu_fresh_output_cache_bytes())
os.environ["QWEN4EXP_DEBUG_CHECKS"] = "0"
os.environ["QWEN4EXP_CPU_GATHER_STREAM_BYTES"] = "99"
os.environ["QWEN4EXP_CPU_FRESH_OUTPUT_CACHE_BYTES"] = "99"
print(qwen4exp_ext.debug_checks_enabled(), ops.cpu_gather_stream_bytes(),
      ops.cpu_fresh_output_cache_bytes())
"""
    run = run_python(
        code,
        QWEN4EXP_DEBUG_CHECKS="1",
        QWEN4EXP_CPU_GATHER_STREAM_BYTES="12345",
        QWEN4EXP_CPU_FRESH_OUTPUT_CACHE_BYTES="4096",
    )
    assert run.returncode == 0, run.stderr
    stream_bytes = 12345 if ops.cpu_gather_stream_bytes() != -1 else -1
    assert run.stdout.split() == ["True", str(stream_bytes), "4096"] * 2


# A bad value of each variable, and the message it gives: tests/test_env_bad_inputs.py.


@pytest.mark.parametrize(
    "value,expected",
    [("false", False), ("off", False), ("NO", False), (" 0 ", False), ("", False)]
    + [("true", True), ("On", True), ("yes", True), ("1", True)],
)
def test_the_debug_checks_take_every_word_of_the_one_flag_parser(value, expected):
    """QWEN4EXP_DEBUG_CHECKS reads the words QWEN4EXP_VLLM_PREFETCH reads (issue #47 item 14:
    "false", "off" and "no" turned the checks on)."""
    run = run_python(
        "import qwen4exp_ext; print(qwen4exp_ext.debug_checks_enabled())",
        QWEN4EXP_DEBUG_CHECKS=value,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(expected)]


def test_the_flag_words():
    from qwen4exp_ext import _switches

    for word in ("1", "true", "TRUE", "on", "ON", "yes", "Yes", " yes\t"):
        assert _switches.parse_flag("QWEN4EXP_X", word) is True
    for word in ("0", "false", "False", "off", "OFF", "no", "No"):
        assert _switches.parse_flag("QWEN4EXP_X", word) is False
    # Empty is no word: env_flag reads it as the variable's default, as every variable's empty.
    for word in ("", "  ", "2", "-1", "ture", "enable", "y", "n", "1.0", "0x1", "on off"):
        with pytest.raises(ValueError, match=f"QWEN4EXP_X must be 1, true, .* got {word!r}"):
            _switches.parse_flag("QWEN4EXP_X", word)


@pytest.mark.parametrize("default", [True, False])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_flag_variable_is_its_default(value, default, monkeypatch):
    from qwen4exp_ext import _switches

    monkeypatch.setenv("QWEN4EXP_X", value)
    assert _switches.env_flag("QWEN4EXP_X", default) is default


@pytest.mark.parametrize("value", [1 << 63, (1 << 64) + 5])
def test_a_stream_threshold_past_int64_names_the_argument(value):
    """Issue #47 item 14: 2**63 failed deep in the op's argument cast, naming no argument."""
    previous = ops.set_cpu_gather_stream_bytes(None)
    try:
        with pytest.raises(ValueError, match=r"stream_bytes must be an int >= 0 or None \(at most"):
            ops.set_cpu_gather_stream_bytes(value)
        assert ops.set_cpu_gather_stream_bytes((1 << 63) - 1) is None  # the largest is taken
    finally:
        ops.set_cpu_gather_stream_bytes(previous)


def test_a_binary_built_for_another_torch_is_refused_at_import():
    code = """
import torch
torch.__version__ = "1.99.0"
import qwen4exp_ext
"""
    run = run_python(code)
    assert run.returncode != 0
    assert "ImportError: qwen4exp_ext was built against torch" in run.stderr
    assert "but torch 1.99.0 is running" in run.stderr
