"""ngram_ids (SPEC §3) kernels on every backend this machine has: parity with the reference
oracle on random varlen batches (int32 output, strided views, more elements than threads), with
transformers 5.18 on chunked documents, the precomputed modulo constants (head_divmod, fresh and
stale), opcheck and a torch.compile smoke test. The properties that the oracle holds too are in
test_properties.py; the bad arguments and the errors they give, in bad_inputs.py."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import backends
from ngram_support import hash_cases, hash_width  # noqa: F401 - hash_width: the fixture
from qwen4exp_ext import ops, reference
from qwen4exp_ext.testing import same_layout

from .support import TOY, Layout, model_layout, random_batch, random_layout, run_both

BACKENDS = backends()
# Every backend, the CPU kernel once per hash width this CPU has (scalar, AVX2, AVX-512).
HASH_CASES = hash_cases(BACKENDS)

pytestmark = pytest.mark.usefixtures("hash_width")  # HASH_CASES tests: their width


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_matches_reference_on_random_varlen_batches(backend, isa, id_dtype):
    rng = random.Random(1234)
    for case in range(250):
        ngram_size = rng.choice([2, 3, 3, 4, 8])
        lay = random_layout(rng, ngram_size, rng.choice([1, 2, 3, 8]))
        vocab = rng.choice([12, 248320, 2**31 - 1])
        input_ids, qsl, context = random_batch(rng, lay, id_dtype, vocab)
        got, expected = run_both(backend, input_ids, qsl, context, lay)
        assert torch.equal(got, expected), f"case {case}"


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
def test_int32_output_and_released_layout(backend, isa):
    lay = model_layout(248320, 3, 8, 20_000_000, 1234, 0, eos=248044)
    rng = random.Random(5)
    for _ in range(20):
        input_ids, qsl, context = random_batch(rng, lay, torch.int64, 248320)
        got, expected = run_both(backend, input_ids, qsl, context, lay, torch.int32)
        assert got.dtype == torch.int32
        assert torch.equal(got.long(), expected)


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
def test_strided_views(backend, isa):
    """input_ids and ngram_context as non-contiguous views, output as a column-sliced view."""
    ops, device = backend.ops, backend.device
    rng = random.Random(7)
    lay = random_layout(rng, 3, 2)
    for _ in range(20):
        input_ids, qsl, context = random_batch(rng, lay, torch.int64, 1000)
        strided_ids = torch.stack([input_ids, input_ids + 1], dim=1)[:, 0]
        strided_ctx = context.t().contiguous().t()
        assert not strided_ids.is_contiguous() or strided_ids.numel() <= 1
        expected = reference.ngram_ids(input_ids, qsl, context, *lay.args())
        dev_lay = lay.to(device)
        wide = torch.zeros(
            input_ids.numel(), 2 * expected.shape[1], dtype=torch.int64, device=device
        )
        out = wide[:, 1::2]
        dev_ids, dev_ctx = same_layout(strided_ids, device), same_layout(strided_ctx, device)
        assert dev_ids.stride() == strided_ids.stride() and dev_ctx.stride() == strided_ctx.stride()
        ops.ngram_ids(dev_ids, qsl.to(device), dev_ctx, *dev_lay.args(), output=out)
        assert torch.equal(out.cpu(), expected)
        assert torch.all(wide[:, 0::2] == 0)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.name == "simt64"], ids=str)
def test_more_elements_than_one_thread_each(backend):
    """Past 2^24 (token, head) elements a thread takes several (a grid counts its threads in 32
    bits on ROCm): 2^20 + 3 tokens of 16 heads."""
    rng = random.Random(3)
    lay = random_layout(rng, 3, 8)
    tokens = 2**20 + 3
    input_ids = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(3))
    qsl = torch.tensor([0, 5, tokens - 7, tokens], dtype=torch.int32)
    context = torch.randint(0, 1000, (3, 2), generator=torch.Generator().manual_seed(4))
    got, expected = run_both(backend, input_ids, qsl, context, lay)
    assert torch.equal(got, expected)


# --- parity with transformers 5.18 -------------------------------------------------------------


def transformers_ngram_module(ngram_size, heads_per_ngram, layer_index):
    """transformers' Qwen4ExpTextNGramEmbedding with an identity-like table: row i holds the value
    i in column 0 (exact in fp32 for these small tables), so its output spells out the row ids."""
    pytest.importorskip("transformers.models.qwen4_exp")
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    nh = (ngram_size - 1) * heads_per_ngram
    config = Qwen4ExpTextConfig(
        vocab_size=97,
        ngram_vocab_size_base=500,
        heads_per_ngram=heads_per_ngram,
        ngram_size=ngram_size,
        seed=99,
        eos_token_id=5,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    module = Qwen4ExpTextNGramEmbedding(
        config, embedding_dim=2 * nh, layer_idx=0, ple_layer_index=layer_index
    )
    with torch.no_grad():
        weight = module.ngram_embedding.weight
        weight.zero_()
        weight[:, 0] = torch.arange(weight.shape[0], dtype=weight.dtype)
    lay = Layout(
        module.layer_multipliers.clone(),
        module.ngram_heads_vocab_sizes.clone(),
        module.ngram_heads_offsets.clone(),
        heads_per_ngram,
        5,
    )
    return module, lay


def transformers_ids(module, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        emb = module(torch.tensor([sequence]), None)[0]
    return emb[:, 0::2].round().long()


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ngram_size,heads_per_ngram,layer_index", [(3, 2, 0), (4, 1, 2)])
def test_matches_transformers_on_random_chunked_batches(
    backend, isa, id_dtype, ngram_size, heads_per_ngram, layer_index
):
    """Whole documents through transformers; the same documents cut into chunks (with the right
    context each) through our kernel, several requests per varlen batch; 100 batches per
    parametrisation (400 on CPU in total)."""
    ops, device = backend.ops, backend.device
    module, lay = transformers_ngram_module(ngram_size, heads_per_ngram, layer_index)
    rng = random.Random(ngram_size * 1000 + layer_index)
    ctx_len = ngram_size - 1
    for case in range(100):
        chunks, contexts, expected = [], [], []
        for _ in range(rng.randint(1, 5)):
            seq = [
                5 if rng.random() < 0.15 else rng.randint(0, 96) for _ in range(rng.randint(1, 24))
            ]
            start = rng.randint(0, len(seq) - 1)
            stop = rng.randint(start, len(seq))
            history = [5] * ctx_len + seq[:start]  # EOS before the document starts
            contexts.append(history[-ctx_len:])
            chunks.append(seq[start:stop])
            expected.append(transformers_ids(module, seq)[start:stop])
        qsl = [0]
        for c in chunks:
            qsl.append(qsl[-1] + len(c))
        dev_lay = lay.to(device)
        got = ops.ngram_ids(
            torch.tensor(sum(chunks, []), dtype=id_dtype, device=device),
            torch.tensor(qsl, dtype=torch.int32, device=device),
            torch.tensor(contexts, dtype=id_dtype, device=device),
            *dev_lay.args(),
        ).cpu()
        assert torch.equal(got, torch.cat(expected)), f"case {case}"


# --- precomputed modulo constants (head_divmod) ------------------------------------------------


def divmod_fields(size: int) -> list[int]:
    """FastDivmodU64 of `size` from Granlund & Montgomery's formulas in Python integers (the
    comment of csrc/common/fast_divmod.h), as the four int64 slots of ngram_head_divmod."""
    ceil_log2 = (size - 1).bit_length()
    multiplier = (2**64 * (2**ceil_log2 - size)) // size + 1
    shift1, shift2 = min(ceil_log2, 1), max(ceil_log2 - 1, 0)
    words = [size, multiplier, shift1 | shift2 << 32, 2**64 % size]
    return [w - 2**64 if w >= 2**63 else w for w in words]  # uint64 bits as int64


@pytest.mark.parametrize(
    "sizes",
    [[1], [1, 2, 3, 4, 1009, 2**31 - 1, 2**32, 2**32 + 15], [2**62, 2**63 - 1, 20000003] * 3],
    ids=["one", "small-and-powers", "large"],
)
def test_ngram_head_divmod_is_the_struct_of_each_size(sizes):
    got = ops.ngram_head_divmod(torch.tensor(sizes))
    assert got.dtype == torch.int64 and got.shape == (len(sizes), 4) and got.is_contiguous()
    assert got.tolist() == [divmod_fields(s) for s in sizes]


def test_ngram_head_divmod_reads_strided_sizes():
    sizes = torch.tensor([1009, 7, 1013, 7, 1019])[::2]
    assert torch.equal(ops.ngram_head_divmod(sizes), ops.ngram_head_divmod(sizes.contiguous()))


@pytest.mark.parametrize(
    "sizes,message",
    [
        (torch.tensor([1009, 0, 1019]), r"head_sizes\[1\] must be positive, got 0"),
        (torch.tensor([-5]), r"head_sizes\[0\] must be positive, got -5"),
        (torch.tensor([1009, 1013], dtype=torch.int32), "head_sizes must be int64 \\[NH\\]"),
        (torch.tensor([[1009, 1013]]), "head_sizes must be int64 \\[NH\\]"),
    ],
    ids=["zero", "negative", "int32", "2-d"],
)
def test_ngram_head_divmod_rejects_bad_sizes(sizes, message):
    with pytest.raises(RuntimeError, match=message):
        ops.ngram_head_divmod(sizes)


def test_ngram_head_divmod_stays_on_the_device_of_the_sizes():
    meta = ops.ngram_head_divmod(torch.empty(5, dtype=torch.int64, device="meta"))
    assert meta.device.type == "meta" and meta.shape == (5, 4) and meta.dtype == torch.int64
    if "cuda" in [b.device for b in BACKENDS]:
        sizes = TOY.sizes.cuda()
        got = ops.ngram_head_divmod(sizes)
        assert got.device == sizes.device
        assert torch.equal(got.cpu(), ops.ngram_head_divmod(TOY.sizes))


def run_with_divmod(backend, input_ids, qsl, context, lay: Layout, head_divmod, out_dtype):
    device = backend.device
    dev_lay = lay.to(device)
    return backend.ops.ngram_ids(
        input_ids.to(device),
        qsl.to(device),
        context.to(device),
        *dev_lay.args(),
        output=torch.full(
            (input_ids.numel(), lay.sizes.numel()), -7, dtype=out_dtype, device=device
        ),
        head_divmod=head_divmod.to(device),
    ).cpu()


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
def test_head_divmod_gives_the_same_ids(backend, isa):
    """Odd shapes (T = 1, 129, 151 over one or several requests, NH = 1..21 heads, sizes over
    the whole int64 range): the same ids with the layer's constants as without, and as the
    reference."""
    rng = random.Random(99)
    for case in range(40):
        ngram_size = rng.choice([2, 3, 4, 8])
        lay = random_layout(rng, ngram_size, rng.choice([1, 3]))
        input_ids, qsl, context = random_batch(rng, lay, torch.int64, 2**40)
        if case % 4 == 0:  # one long odd request
            tokens = rng.choice([1, 129, 151])
            input_ids = torch.randint(
                0, 50, (tokens,), generator=torch.Generator().manual_seed(case)
            )
            qsl = torch.tensor([0, tokens], dtype=torch.int32)
            context = torch.full((1, lay.context_len), lay.eos)
        out_dtype = torch.int64
        with_constants = run_with_divmod(
            backend, input_ids, qsl, context, lay, ops.ngram_head_divmod(lay.sizes), out_dtype
        )
        without, expected = run_both(backend, input_ids, qsl, context, lay, out_dtype)
        assert torch.equal(with_constants, without), f"case {case}"
        assert torch.equal(with_constants, expected), f"case {case}"


def stale_constants(lay: Layout, rng: random.Random) -> torch.Tensor:
    """Constants of other sizes for about half the heads (each off by a little or a lot), the
    right ones for the rest."""
    sizes = lay.sizes.tolist()
    other = [
        s if rng.random() < 0.5 else rng.choice([s + 1, s + 2, max(1, s - 1), 3, 2**40 + 7])
        for s in sizes
    ]
    if other == sizes:
        other[0] = sizes[0] + 1
    return ops.ngram_head_divmod(torch.tensor(other))


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
@pytest.mark.parametrize("out_dtype", [torch.int64, torch.int32])
def test_stale_head_divmod_still_gives_the_right_ids(backend, isa, out_dtype):
    """Constants built for other sizes (another layer's, or from before the sizes were
    reloaded): every head whose stored divisor is not its size is computed as without them.
    Used as they are, such constants would give ids outside the head's range."""
    rng = random.Random(5)
    for case in range(30):
        lay = model_layout(248320, rng.choice([2, 3, 4]), rng.choice([1, 2, 8]), 20_000, case, 0, 9)
        input_ids, qsl, context = random_batch(rng, lay, torch.int64, 248320)
        got = run_with_divmod(
            backend, input_ids, qsl, context, lay, stale_constants(lay, rng), out_dtype
        )
        expected = reference.ngram_ids(input_ids, qsl, context, *lay.args())
        assert torch.equal(got.long(), expected), f"case {case}"


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_the_hip_kernel_uses_the_constants_it_is_given(backend):
    """What the two kernels do with constants whose divisor matches: the HIP kernel uses them
    as given (which is what saves it the work, so ids computed from a corrupted multiplier
    differ); the CPU kernel builds its own and never reads them. This is what makes the tests
    above prove the HIP kernel's reading of the constants, not just its fallback."""
    lay = TOY
    corrupted = ops.ngram_head_divmod(lay.sizes)
    corrupted[:, 1] += 12345  # the multiplier; the divisor still matches
    input_ids = torch.tensor([9, 7, 3, 5, 11, 2, 40])
    qsl = torch.tensor([0, 4, 7], dtype=torch.int32)
    context = torch.tensor([[7, 7], [1, 2]])
    got = run_with_divmod(backend, input_ids, qsl, context, lay, corrupted, torch.int64)
    expected = reference.ngram_ids(input_ids, qsl, context, *lay.args())
    if backend.reads_indices_on_device:
        assert not torch.equal(got, expected)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.reads_indices_on_device], ids=str)
def test_head_divmod_with_a_non_positive_size_gives_minus_one(backend):
    """On the device a head of size <= 0 gives id -1 (a zero row) with constants too, whatever
    its stored constants say."""
    lay = TOY
    sizes = lay.sizes.clone()
    sizes[1] = 0
    sizes[2] = -3
    constants = ops.ngram_head_divmod(lay.sizes)
    constants[2, 0] = -3  # a stored "divisor" equal to the bad size
    bad = Layout(lay.multipliers, sizes, lay.offsets, lay.heads_per_ngram, lay.eos)
    input_ids = torch.tensor([9, 7, 3, 5])
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    context = torch.tensor([[7, 7]])
    got = run_with_divmod(backend, input_ids, qsl, context, bad, constants, torch.int64)
    expected = reference.ngram_ids(input_ids, qsl, context, *lay.args())
    assert torch.all(got[:, 1:3] == -1)
    assert torch.equal(got[:, [0, 3]], expected[:, [0, 3]])


# --- opcheck, compile, errors -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("case", range(12))
def test_opcheck(backend, case):
    device = backend.device
    rng = random.Random(100 + case)
    lay = random_layout(rng, rng.choice([2, 3, 4]), rng.choice([1, 2, 8])).to(device)
    id_dtype = torch.int32 if case % 2 else torch.int64
    input_ids, qsl, context = random_batch(rng, lay, id_dtype, 5000)
    out = torch.empty(
        input_ids.numel(),
        lay.context_len * lay.heads_per_ngram,
        dtype=torch.int32 if case % 3 == 0 else torch.int64,
        device=device,
    )
    if out.dtype == torch.int32:  # int32 output needs every id to fit
        lay.sizes.clamp_(max=1 << 20)
        lay.offsets.copy_(torch.cumsum(lay.sizes, 0) - lay.sizes)
    args = (
        input_ids.to(device),
        qsl.to(device),
        context.to(device),
        lay.multipliers,
        lay.sizes,
        lay.offsets,
        lay.eos,
        lay.heads_per_ngram,
        out,
    )
    torch.library.opcheck(backend.library.ngram_ids.default, args)
    # With the layer's constants, and with stale ones (other sizes: the kernel's fallback).
    torch.library.opcheck(
        backend.library.ngram_ids.default,
        (*args, ops.ngram_head_divmod(lay.sizes.cpu()).to(device)),
    )
    torch.library.opcheck(
        backend.library.ngram_ids.default,
        (*args, ops.ngram_head_divmod(lay.sizes.cpu() + 1).to(device)),
    )


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_torch_compile_smoke(backend):
    ops, device = backend.ops, backend.device
    lay = TOY.to(device)

    @torch.compile(fullgraph=True, dynamic=True)
    def hashed(input_ids, qsl, context, head_divmod):
        return ops.ngram_ids(input_ids, qsl, context, *lay.args(), head_divmod=head_divmod) + 1

    input_ids = torch.tensor([9, 7, 3, 5, 11], device=device)
    qsl = torch.tensor([0, 4, 5], dtype=torch.int32, device=device)
    context = torch.tensor([[7, 7], [1, 2]], device=device)
    eager = ops.ngram_ids(input_ids, qsl, context, *lay.args()) + 1
    assert torch.equal(hashed(input_ids, qsl, context, None), eager)
    constants = ops.ngram_head_divmod(lay.sizes)
    assert torch.equal(hashed(input_ids, qsl, context, constants), eager)
