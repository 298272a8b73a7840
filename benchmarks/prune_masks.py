"""How long sparsecc takes to prune a layer on the CPU, next to computing its mask alone.

For an 11008x4096 fp32 weight (random normal, never zeros; the MLP up-projection of a 7B
LLaMA) it times, for 2:4, 3:32, 4:8, 2:4/vw4, 2:4/bw32, block32x32@0.25 and
unstructured@0.1 (magnitude criterion):

- the mask alone, :func:`sparsecc.pruning.pattern_mask` on the weight (``section:
  "patterns"``): choosing what to keep, the part whose cost grows with the pattern;
- ``sparsecc.prune`` end to end on an ``nn.Linear(4096, 11008)`` holding that weight
  (``section: "prune"``): the mask, zeroing the weight in place and the report (density
  before and after, |w| kept). The weight is restored between runs, outside the timing.

The two are timed in alternation, one run of each in turn after a warm-up of each, so a
busy neighbour slows both alike; a prune row's ``ratio`` is its median over the median of
the mask runs beside it. The goal: prune within 1.5x of the mask for every pattern. Then it
times the mask for 2:4 and 3:32 at 1/4, 1/2, 1 and 2 times that many elements to show the
cost is linear (``section: "linearity"``); the goal there: 2:4 and 3:32 each under 0.5 s on
a 2-core CPU.

    python benchmarks/prune_masks.py [--runs 7] [--out benchmarks/results]

Writes ``prune_masks-cpu-<date>.json`` (the shape every sparsecc results file has) and a plot
beside it: mask time against elements (log-log), and mask against prune per pattern. Keys of
each row, besides ``pattern``, ``shape``, ``numel``, ``ms`` (median over ``runs``) and
``ns_per_element`` (``ms`` per element): ``section``, ``ms_min`` (the fastest run) and
``runs``; prune rows add ``mask_ms`` (the median of the mask runs timed with them) and
``ratio``. Top-level extras: ``threads`` (torch's intra-op threads) and ``load_avg`` /
``load_avg_end`` (the 1-minute load average when the run started and ended: on a shared
machine, a busy neighbour shows).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import sparsecc
from sparsecc.pruning import pattern_mask, prune

SHAPE = (11008, 4096)
PATTERNS = ["2:4", "3:32", "4:8", "2:4/vw4", "2:4/bw32", "block32x32@0.25", "unstructured@0.1"]
LINEARITY_PATTERNS = ["2:4", "3:32"]
LINEARITY_SCALES = [0.25, 0.5, 1.0, 2.0]
ACCEPTANCE_MS = {"2:4": 500.0, "3:32": 500.0}
#: prune's time over the mask's, at most
ACCEPTANCE_RATIO = 1.5


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def random_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Normal samples pushed away from zero (a zero would be a free choice for the mask)."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    return x.add_(x.sign() * 1e-3)


def time_mask(pattern: str, weight: torch.Tensor, runs: int) -> list[float]:
    """Wall-clock milliseconds of ``runs`` mask computations, after one warm-up."""
    pattern_mask(pattern, weight)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        pattern_mask(pattern, weight)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def time_mask_and_prune(pattern: str, weight: torch.Tensor,
                        runs: int) -> tuple[list[float], list[float]]:
    """Milliseconds of ``runs`` mask computations and ``runs`` ``sparsecc.prune`` calls on a
    linear layer holding ``weight``, in alternation, after a warm-up of each. The layer gets
    ``weight`` back before every prune, outside the timing."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)

    def prune_once() -> float:
        with torch.no_grad():
            layer.weight.copy_(weight)
        start = time.perf_counter()
        prune(layer, pattern)
        return (time.perf_counter() - start) * 1e3

    def mask_once() -> float:
        start = time.perf_counter()
        pattern_mask(pattern, weight)
        return (time.perf_counter() - start) * 1e3

    mask_once(), prune_once()
    mask_times, prune_times = [], []
    for _ in range(runs):
        mask_times.append(mask_once())
        prune_times.append(prune_once())
    return mask_times, prune_times


def row(section: str, pattern: str, weight: torch.Tensor, times: list[float]) -> dict:
    ms = statistics.median(times)
    return {"section": section, "pattern": pattern, "shape": list(weight.shape),
            "numel": weight.numel(), "ms": round(ms, 2), "ms_min": round(min(times), 2),
            "ns_per_element": round(ms * 1e6 / weight.numel(), 3), "runs": len(times)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 5))
    masks = [r for r in rows if r["section"] != "prune"]
    for pattern in dict.fromkeys(r["pattern"] for r in masks):
        # a line over the linearity sizes where there are some, else the one size's point
        mine = [r for r in masks if r["pattern"] == pattern]
        points = sorted((r["numel"], r["ms"]) for r in mine
                        if r["section"] == "linearity" or len(mine) == 1)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=pattern)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axhline(500, color="grey", linestyle="--", linewidth=1, label="0.5 s (the goal for 2:4 and 3:32)")
    ax.set_xlabel("weight elements")
    ax.set_ylabel("mask time, median (ms)")
    ax.set_title("mask alone, by size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    pruned = [r for r in rows if r["section"] == "prune"]
    x = range(len(pruned))
    bars.bar([i - 0.2 for i in x], [r["mask_ms"] for r in pruned], width=0.4, label="mask alone")
    bars.bar([i + 0.2 for i in x], [r["ms"] for r in pruned], width=0.4, label="sparsecc.prune")
    for i, r in zip(x, pruned):
        bars.annotate(f"{r['ratio']:.2f}x", (i + 0.2, r["ms"]), ha="center", va="bottom", fontsize=8)
    bars.set_xticks(list(x), [r["pattern"] for r in pruned], rotation=30, ha="right", fontsize=8)
    bars.set_yscale("log")
    bars.set_ylabel("median (ms)")
    bars.set_title(f"{pruned[0]['shape'][0]}x{pruned[0]['shape'][1]} fp32: mask vs prune (goal: "
                   f"{ACCEPTANCE_RATIO}x)" if pruned else "prune")
    bars.grid(True, axis="y", which="both", alpha=0.3)
    bars.legend(fontsize=8)
    fig.suptitle(f"sparsecc pruning on {cpu_name()} ({torch.get_num_threads()} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    load_avg = os.getloadavg()[0]
    weight = random_weight(*SHAPE)
    rows = []
    for pattern in PATTERNS:
        mask_times, prune_times = time_mask_and_prune(pattern, weight, args.runs)
        rows.append(row("patterns", pattern, weight, mask_times))
        rows.append({**row("prune", pattern, weight, prune_times), "mask_ms": rows[-1]["ms"],
                     "ratio": round(statistics.median(prune_times) / statistics.median(mask_times), 3)})
    for pattern in LINEARITY_PATTERNS:
        for scale in LINEARITY_SCALES:
            scaled = weight if scale == 1.0 else random_weight(int(SHAPE[0] * scale), SHAPE[1], seed=1)
            rows.append(row("linearity", pattern, scaled, time_mask(pattern, scaled, args.runs)))
            del scaled

    date = datetime.date.today().isoformat()
    result = {"bench": "prune_masks", "device": cpu_name(), "torch": torch.__version__, "cuda": None,
              "sparsecc": sparsecc.__version__, "date": date, "threads": torch.get_num_threads(),
              "load_avg": round(load_avg, 2), "load_avg_end": round(os.getloadavg()[0], 2), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"prune_masks-cpu-{date}.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, json_path.with_suffix(".png"))

    print(f"{'section':10} {'pattern':18} {'shape':>12} {'ms':>9} {'ms min':>9} {'ns/elem':>8}")
    for r in rows:
        print(f"{r['section']:10} {r['pattern']:18} {'x'.join(map(str, r['shape'])):>12} "
              f"{r['ms']:9.1f} {r['ms_min']:9.1f} {r['ns_per_element']:8.2f}")
    for pattern, limit in ACCEPTANCE_MS.items():
        ms = next(r["ms"] for r in rows if r["section"] == "patterns" and r["pattern"] == pattern)
        print(f"{pattern} at {SHAPE[0]}x{SHAPE[1]}: {ms:.0f} ms ({'under' if ms < limit else 'OVER'} "
              f"{limit:.0f} ms)")
    for r in rows:
        if r["section"] == "prune":
            verdict = "within" if r["ratio"] <= ACCEPTANCE_RATIO else "OVER"
            print(f"prune {r['pattern']}: {r['ms']:.0f} ms, mask {r['mask_ms']:.0f} ms: "
                  f"{r['ratio']:.2f}x ({verdict} {ACCEPTANCE_RATIO}x)")
    print(f"wrote {json_path} and {json_path.with_suffix('.png').name} (load average {load_avg:.2f})")
    return result


if __name__ == "__main__":
    main()
