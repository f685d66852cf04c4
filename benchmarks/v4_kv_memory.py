"""DeepSeek-V4's hybrid KV memory per token, computed and measured, beside Llama-3-8B's.

    python benchmarks/v4_kv_memory.py [--contexts 8192,131072,1048576] [--measure-up-to 1048576]
        [--out v4_kv_memory.json]

For one request of each context length, in bf16:
  analytic   bytes per token from the architecture alone (docs/deepseek_v4.md, "What a request
             keeps"): compressed rows (CSA every 4 tokens, HCA every 128) and CSA indexer keys per
             token, plus the sliding windows' last 127 rows per layer, once per request
  computed   what the engine's KV layout (the model's kv_cache_specs, kv_cache/tensors.py) holds
             for it: whole blocks of 128 tokens in every pool, page tails (the compressor's carry
             state) included, the window pool's 2 blocks per layer group
  measured   those pools allocated by KVLayout.allocate on the device: the allocator's growth
             (torch.cuda.memory_allocated on CUDA; on the CPU the allocated tensors' bytes),
             for contexts up to --measure-up-to
V4-Flash's shape (43 layers: 2 sliding-only, 21 CSA, 20 HCA; head_dim 512, index_head_dim 128,
window 128; the MTP layer's window is not counted) needs no weights: only its KV specs are built.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info, print_table, write_json
from gpu_reference_baseline import LLAMA3_8B

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def v4_flash_config() -> dict:
    """V4-Flash's config fields that its KV depends on (docs/deepseek_v4.md, shapes)."""
    layer_types = [SLIDING, SLIDING] + [CSA, HCA] * 20 + [CSA]
    return dict(architectures=["DeepseekV4ForCausalLM"], vocab_size=129280, hidden_size=4096,
                num_hidden_layers=43, num_attention_heads=64, head_dim=512, partial_rotary_factor=0.125,
                q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, layer_types=layer_types,
                compress_rates={CSA: 4, HCA: 128}, index_n_heads=64, index_head_dim=128, index_topk=512,
                hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, n_routed_experts=256, num_experts_per_tok=6,
                moe_intermediate_size=2048, num_nextn_predict_layers=1, max_position_embeddings=1 << 20)


def analytic_bytes(cfg: dict, context: int, itemsize: int = 2) -> float:
    kinds = cfg["layer_types"]
    d, di, window = cfg["head_dim"], cfg["index_head_dim"], cfg["sliding_window"]
    rates = cfg["compress_rates"]
    rows = sum(d / rates[k] for k in kinds if k != SLIDING) + sum(di / rates[CSA] for k in kinds if k == CSA)
    windows = len(kinds) * (window - 1) * d
    return (rows * context + windows) * itemsize


def layouts(dtype):
    from deepinfer.kv_cache.specs import FullAttentionSpec
    from deepinfer.kv_cache.tensors import KVLayout
    from deepinfer.models.deepseek_v4.config import V4Config
    from deepinfer.models.deepseek_v4.engine import kv_cache_specs_for

    v4 = KVLayout.from_specs(kv_cache_specs_for(V4Config.from_hf(v4_flash_config()), dtype), 128, dtype)
    llama = LLAMA3_8B
    spec = FullAttentionSpec(llama["num_key_value_heads"], llama["hidden_size"] // llama["num_attention_heads"], dtype)
    return {"deepseek-v4-flash": v4, "llama3-8b": KVLayout.from_specs([spec] * llama["num_hidden_layers"], 16, dtype)}


def blocks_for(layout, context: int) -> list[int]:
    """Block ids per pool one request of `context` tokens holds (+ each pool's null block)."""
    bs = layout.block_size
    need = []
    for pool in range(layout.num_pools):
        groups = [g for g in layout.groups if g.pool_id == pool]
        per_group = [-(-min(context, g.spec.num_needed_tokens(context) + 1) // bs) + 1
                     if g.spec.num_needed_tokens(context) < context else -(-context // bs) for g in groups]
        need.append(sum(per_group) + 1)
    return need


def measure(layout, blocks: list[int], device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        caches = layout.allocate(blocks, device)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
    else:
        caches = layout.allocate(blocks, device)
        grown = sum({id(t): t.untyped_storage().nbytes() for pair in caches for t in pair}.values())
    del caches
    return grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="8192,131072,1048576")
    parser.add_argument("--measure-up-to", type=int, default=1 << 20, help="allocate contexts up to this many tokens")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    from deepinfer.platforms import current_platform

    device = current_platform().device
    contexts = [int(c) for c in args.contexts.split(",")]
    result = {"benchmark": "v4_kv_memory", "machine": machine_info(), "device": str(device), "rows": []}
    for name, layout in layouts(torch.bfloat16).items():
        for context in contexts:
            blocks = blocks_for(layout, context)
            computed = layout.total_bytes(blocks)
            measured = measure(layout, blocks, device) if context <= args.measure_up_to else None
            analytic = (analytic_bytes(v4_flash_config(), context) if name.startswith("deepseek")
                        else 2 * 2 * LLAMA3_8B["num_hidden_layers"] * LLAMA3_8B["num_key_value_heads"] * 128 * context)
            result["rows"].append({"model": name, "context": context, "pools": layout.num_pools,
                                   "pool_blocks": blocks, "analytic_bytes": analytic, "computed_bytes": computed,
                                   "measured_bytes": measured, "analytic_per_token": analytic / context,
                                   "computed_per_token": computed / context,
                                   "measured_per_token": None if measured is None else measured / context})
            print(f"{name} {context}: computed {computed / 2**20:.1f} MiB, measured "
                  f"{'-' if measured is None else f'{measured / 2**20:.1f} MiB'}", flush=True)
    rows = result["rows"]
    by = {(r["model"], r["context"]): r for r in rows}
    for r in rows:
        llama = by.get(("llama3-8b", r["context"]))
        r["vs_llama"] = llama["computed_bytes"] / r["computed_bytes"] if llama else math.nan
    print()
    print_table(rows, [("model", "model", ""), ("context", "context", "d"), ("analytic_per_token", "analytic B/tok", ".0f"),
                       ("computed_per_token", "computed B/tok", ".0f"), ("measured_per_token", "measured B/tok", ".0f"),
                       ("computed_bytes", "computed bytes", ".3e"), ("vs_llama", "Llama / this", ".1f")])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
