"""Print a markdown table of deepinfer beside an anchor engine, from two throughput JSON files.

    python benchmarks/compare_throughput.py ours.json anchor.json
"""

from __future__ import annotations

import json
import sys


def main(ours_path: str, anchor_path: str) -> None:
    ours = {r["concurrency"]: r for r in json.load(open(ours_path))}
    anchor = {r["concurrency"]: r for r in json.load(open(anchor_path))}
    name = next(iter(anchor.values()))["engine"]
    print(f"| concurrency | requests | deepinfer out tok/s | {name} out tok/s | ratio | "
          f"deepinfer total tok/s | {name} total tok/s |")
    print("|---|---|---|---|---|---|---|")
    for c in sorted(ours):
        o, a = ours[c], anchor.get(c)
        if a is None:
            continue
        print(f"| {c} | {o['num_prompts']} | {o['output_throughput']:.1f} | {a['output_throughput']:.1f} | "
              f"{o['output_throughput'] / a['output_throughput']:.2f}x | {o['total_token_throughput']:.1f} | "
              f"{a['total_token_throughput']:.1f} |")
    if 32 in ours and 16 in anchor:
        print(f"\n32-stream deepinfer / 16-stream {name} aggregate output: "
              f"{ours[32]['output_throughput'] / anchor[16]['output_throughput']:.2f}x")


if __name__ == "__main__":
    main(*sys.argv[1:3])
