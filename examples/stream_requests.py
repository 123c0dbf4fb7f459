"""Stream requests through one PLE layer without vLLM, and compare with transformers.

Builds a small random Qwen4Exp PLE layer in transformers (non-zero conv weights), loads its state
dict into :class:`qwen4exp_ext.layers.PLELayer`, then serves 3 requests of different lengths
(EOS inside) through a :class:`qwen4exp_ext.layers.PLEState` with 2 slots: chunked prefill,
token-by-token decode, mixed batches, and a finished request's slot reused. Prints the max
difference to transformers' whole-sequence output per request.

    python examples/stream_requests.py [--device cuda] [--dtype bfloat16]

Runs in a few seconds on a CPU; needs ``transformers>=5.18`` (with ``qwen4_exp``).
"""

from __future__ import annotations

import argparse
import random

import torch

from qwen4exp_ext.layers import PLELayer, PLEState


def tiny_config(eos: int):
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        hc_count=4,
        hc_lowrank=8,
        ple_layer_ids=[1],
        ple_embed_dim=64,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=4,
        ngram_vocab_size_base=5000,
        seed=1234,
        eos_token_id=eos,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "linear_attention"],
        rms_norm_eps=1e-6,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

    eos = 2
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    cfg = tiny_config(eos)
    theirs = Qwen4ExpTextPLELayer(cfg, layer_idx=0, ple_layer_index=0).eval()
    with torch.no_grad():
        for norm in (theirs.norm_key, theirs.norm_query, theirs.norm_conv):
            norm.weight.normal_(0.0, 0.3)
        theirs.conv1d.weight.normal_(0.0, 0.5)  # the checkpoint's are non-zero; init is zero

    ours = PLELayer.from_config(cfg, 0, dtype=dtype, device=args.device)
    ours.load_state_dict_transformers(theirs.state_dict())
    cache = PLEState.from_config(cfg, max_requests=2, dtype=dtype, device=args.device)

    C = cfg.hc_count * cfg.hidden_size
    requests = {}
    for rid, (length, prompt) in {"a": (40, 25), "b": (17, 9), "c": (28, 14)}.items():
        ids = torch.randint(0, cfg.vocab_size, (length,))
        ids[length // 3] = eos
        requests[rid] = dict(ids=ids, hidden=torch.randn(length, C), prompt=prompt, pos=0, out=[])

    waiting, live, step = list(requests), [], 0
    while waiting or live:
        while waiting and len(live) < cache.max_requests:
            rid = waiting.pop(0)
            print(f"step {step:3d}: add {rid} -> slot {cache.add_request(rid)}")
            live.append(rid)
        chunks, hidden = [], []
        for rid in live:
            r = requests[rid]
            p = r["pos"]
            n = rng.randint(1, r["prompt"] - p) if p < r["prompt"] else 1  # prefill / decode
            chunks.append((rid, r["ids"][p : p + n]))
            hidden.append(r["hidden"][p : p + n])
        batch = cache.prepare(chunks)
        with torch.no_grad():
            out = ours(torch.cat(hidden).to(args.device, dtype), batch.input_ids, batch)
        cache.commit(batch)
        modes = "+".join(g.mode for g in batch.groups)
        print(f"step {step:3d}: {modes:15s} " + " ".join(f"{rid}:{len(t)}" for rid, t in chunks))
        for rid, rows in batch.request_rows().items():
            r = requests[rid]
            r["out"].append(out[rows].float().cpu())
            r["pos"] += rows.stop - rows.start
            if r["pos"] == len(r["ids"]):
                cache.finish_request(rid)
                live.remove(rid)
                print(f"step {step:3d}: finish {rid}")
        step += 1

    worst = 0.0
    for rid, r in requests.items():
        with torch.no_grad():
            expected = theirs(r["hidden"][None], r["ids"][None], None)[0]
        diff = (torch.cat(r["out"]) - (r["hidden"] + expected)).abs().max().item()
        rel = diff / expected.abs().max().item()
        worst = max(worst, rel)
        print(
            f"request {rid}: {len(r['ids'])} tokens, max |ours - transformers| = {diff:.3e} "
            f"({rel:.2e} of max |transformers|)"
        )
    print(f"max relative difference: {worst:.2e}")


if __name__ == "__main__":
    main()
