"""ple_gate past 2^31 and 2^32 elements (issue #48): key, value and hidden rows read from, and
gated and conv_input rows written to, token rows that straddle and pass those marks of their
storage (views into sparse files: tests/large_offsets_support.py), on the CPU kernel and the HIP
kernel on the SIMT emulator, against the oracle and against the same kernel on compact copies.
vLLM 0.34 fixed the same bug in its Triton kernels: program ids and offsets computed in int32."""

from __future__ import annotations

import pytest
import torch

from conftest import backends
from large_offsets_support import TOKEN_ROWS, run_leaving_nothing, seed, token_rows
from qwen4exp_ext import reference
from qwen4exp_ext.testing import assert_exact

from .support import DTYPES, EPS, assert_close

BACKENDS = [b for b in backends() if b.device == "cpu"]
# (streams M, width H): the HIP kernel's whole-chunk path (H a multiple of its 16-byte vectors,
# rows aligned) and its ragged one (value's rows start at an odd column of the projection).
SHAPES = {"whole": (4, 64), "ragged": (3, 37)}


def check_gate(files, backend, dtype):
    for shape in SHAPES:
        check_gate_shape(files, backend, dtype, shape)


def check_gate_shape(files, backend, dtype, shape):
    streams, width = SHAPES[shape]
    channels = streams * width
    gen = torch.Generator().manual_seed(seed(str(dtype), shape))
    # key and value: column slices of one [T, C + H] projection, as the layer makes them.
    projection = token_rows(files, dtype, channels + width)
    projection.copy_(torch.randn(TOKEN_ROWS, channels + width, generator=gen).to(dtype))
    key, value = projection[:, :channels], projection[:, channels:]
    hidden = token_rows(files, dtype, channels)
    hidden.copy_((torch.randn(TOKEN_ROWS, channels, generator=gen) * 3).to(dtype))
    weights = [(torch.randn(channels, generator=gen) * 0.2).to(dtype) for _ in range(3)]
    compact = [t.clone() for t in (key, value, hidden)]
    gated, conv_input = token_rows(files, dtype, channels), token_rows(files, dtype, channels)
    for rounding in ("vllm", "fp32"):
        expected = reference.ple_gate(*compact, *weights, EPS, rounding=rounding)
        same = backend.ops.ple_gate(*compact, *weights, EPS, rounding=rounding)
        gated.fill_(float("nan"))  # a row not written shows
        conv_input.fill_(float("nan"))
        out = (gated, conv_input)
        got = backend.ops.ple_gate(key, value, hidden, *weights, EPS, rounding=rounding, out=out)
        assert got[0] is gated and got[1] is conv_input
        fresh = backend.ops.ple_gate(key, value, hidden, *weights, EPS, rounding=rounding)
        for name, k in (("gated", 0), ("conv_input", 1)):
            for how, result in (("out=", got[k].clone()), ("new", fresh[k])):
                what = f"{shape} {rounding} {name} ({how})"
                assert_close(result, expected[k], dtype, rounding, what)
                # Where the rows lie changes nothing: the kernel's own result on compact copies.
                assert_exact(result, same[k], f"{what} against compact rows", bitwise=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_past_2_31_and_2_32_elements(tmp_path, backend, dtype):
    """Token rows straddling element 2^31 (row 1) and 2^32 (row 2) of their storage and past both
    (row 3): key and value as column slices of one projection, hidden, and ``out=`` (gated,
    conv_input), in both roundings, the HIP kernel's whole and ragged paths. Catches
    ``t * key_row_stride`` (and value's, hidden's, gated's and conv_input's) computed in 32 bits:
    what vLLM 0.34 fixed in its Triton gate by taking the program id as int64."""
    run_leaving_nothing(tmp_path, check_gate, backend, dtype)


def check_refused(files, backend, channels):
    # H = 1, so M = C streams: one sparse [C] view serves as key, hidden and the three weights
    # (nothing is read: the op must refuse before it reads or writes anything).
    storage = files.tensor(torch.bfloat16, (channels,), (1,))
    row = storage.view(1, channels)
    value = torch.ones(1, 1, dtype=torch.bfloat16)
    gated = files.tensor(torch.bfloat16, (1, channels), (channels, 1))
    conv_input = files.tensor(torch.bfloat16, (1, channels), (channels, 1))
    for t in (gated, conv_input):  # a write shows at either end
        t[0, :4] = float("nan")
        t[0, -4:] = float("nan")
    args = (row, value, row, storage, storage, storage, EPS)
    message = rf"C / H = {channels} streams is more than the supported 2\^31 - 1"
    for out in (None, (gated, conv_input)):
        with pytest.raises(RuntimeError, match=message):
            backend.ops.ple_gate(*args, out=out)
    for t in (gated, conv_input):
        assert bool(t[0, :4].isnan().all() and t[0, -4:].isnan().all()), "a refused call wrote"


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("channels", [2**31, 2**32 + 2])
def test_streams_past_2_31_refused(tmp_path, backend, channels):
    """M = C / H streams past 2^31 - 1 (H = 1, hidden rows of 2^31 and 2^32 + 2 elements in
    sparse files): refused before anything is read or written, on the CPU and the emulator, as
    an H past 2^24 is. The params hold M in 32 bits: before this check M = 2^32 + 2 became 2
    streams (the rest of the outputs left unwritten, no error) and M = 2^31 a negative count
    (the CPU raised std::vector's "vector::_M_default_append", the emulator returned having
    written nothing)."""
    run_leaving_nothing(tmp_path, check_refused, backend, channels)
