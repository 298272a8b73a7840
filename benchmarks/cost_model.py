"""Does the cost model choose well? On a grid of shapes x sparsity patterns x densities x M,
time every exact candidate of each point (sparsecc.runtime.timing, the measurement the model
is calibrated with) and compare with the model's choice and prediction. The choice is made as
compile makes it, by timing the shortlist the predictions make (a measurement of its own,
before every candidate is timed for the row). Run as a script it sets ``SPARSECC_TUNE=off``
and leaves this machine's tuned launches out (common.fixed_dispatch): sites on sparsecc's
kernels run the shipped tuning table's launches, the same on every run, and nothing is tuned
while the grid is timed.

    python benchmarks/cost_model.py --device cuda          # calibrates first, then the grid
    python benchmarks/cost_model.py --device cpu --calibration cached

Rows (one per point, besides the common keys): ``us_chosen`` (measured time of the chosen
format), ``us_best`` / ``best_format`` (the fastest measured candidate), ``us_dense``,
``us_predicted`` (the model's prediction for its choice), ``pattern``, ``calibrated_shape``
(whether the calibration measured this (N, K)) and ``candidates`` (format -> measured and
predicted us). The summary says how often the choice is within 10% of the best, the worst
slowdown against dense, and how often predictions are within 25%.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

if __name__ == "__main__":
    common.fixed_dispatch()     # SPARSECC_TUNE=off: the shipped table's launches (see the docstring)

from sparsecc.ir.analysis import analyze  # noqa: E402
from sparsecc.ir.formats import FormatSpec  # noqa: E402
from sparsecc.ir.weights import random_weight  # noqa: E402
from sparsecc.planner import fit as calib  # noqa: E402
from sparsecc.planner.calibrate import calibrate  # noqa: E402
from sparsecc.planner.cost import CostModel, exact_candidates, site_runner  # noqa: E402
from sparsecc.runtime.cache_files import device_name  # noqa: E402
from sparsecc.runtime.timing import time_all_us  # noqa: E402

PATTERNS = [("2:4", 0.5), ("block32", 0.5), ("block32", 0.25), ("block32", 0.1), ("block32", 0.05),
            ("block64", 0.5), ("block64", 0.1), ("unstructured", 0.3), ("unstructured", 0.1),
            ("unstructured", 0.05), ("unstructured", 0.01)]
GRID = {
    "cuda": {"shapes": [(11008, 4096), (4096, 11008), (4096, 4096), (3072, 768), (768, 3072), (1024, 4096),
                        (2560, 10240), (6144, 1536)],
             "M": (1, 16, 128, 2048), "dtypes": ("float16",)},
    "cpu": {"shapes": [(256, 1024), (1024, 256), (512, 512), (1024, 1024), (1536, 384), (640, 1280)],
            "M": (1, 8, 64, 256), "dtypes": ("float32",), "extra": {"bfloat16": [(512, 512), (1024, 256)]}},
}


def points(device: str, quick: bool):
    grid = GRID[device]
    work = [(dtype, shape) for dtype in grid["dtypes"] for shape in grid["shapes"]]
    work += [(dtype, shape) for dtype, shapes in grid.get("extra", {}).items() for shape in shapes]
    if quick:
        work = work[:2]
    for dtype, (n, k) in work:
        for pattern, density in PATTERNS:
            yield dtype, n, k, pattern, density


def run_point(model: CostModel, weight, stats, m: int, device) -> dict:
    decision = model.decide(stats, m, None, measure_sites=model.site_timer(weight, stats))
    candidates = {}
    for spec in exact_candidates(stats, None):
        candidates[str(spec)] = {"us": None, "predicted": round(model.predict_us(stats, spec, m), 3),
                                 "workload": asdict(model.workload(stats, spec, m))}
    row = {"format": str(decision.choice), "candidates": candidates, "reason": decision.reason}
    time_candidates(model, weight, stats, m, device, row)
    return row


def time_candidates(model: CostModel, weight, stats, m: int, device, row: dict) -> None:
    """Time every candidate of a row (interleaved rounds on the CPU), keep each one's fastest
    time so far, and fill in the row's measured fields."""
    candidates, runners = row["candidates"], {}
    for name, candidate in candidates.items():
        spec = FormatSpec.parse(name)
        try:
            runner = site_runner(weight, spec, m, on_kernel=model.uses_kernel(stats, spec), planned_m=m)
            runner()
            runners[name] = runner
        except RuntimeError as error:          # recorded: a candidate the model may pick must run
            candidate["error"] = str(error)[:200]
    for name, us in time_all_us(runners, device).items():
        old = candidates[name]["us"]
        candidates[name]["us"] = round(us if old is None else min(old, us), 3)
    chosen = row["format"]
    ran = {f: c["us"] for f, c in candidates.items() if c["us"] is not None}
    best = min(ran, key=ran.get)
    row.update(us=candidates[chosen]["us"], us_chosen=candidates[chosen]["us"], us_best=candidates[best]["us"],
               best_format=best, us_dense=candidates["dense"]["us"], us_predicted=candidates[chosen]["predicted"])


def summarize(rows: list[dict]) -> dict:
    if not rows:
        return {}
    failed = [r for r in rows if r["us_chosen"] is None]        # the chosen format did not run
    rows = [r for r in rows if r["us_chosen"] is not None]
    near = [r["us_chosen"] <= 1.10 * r["us_best"] for r in rows]
    regret = [r["us_chosen"] / r["us_dense"] for r in rows]
    predicted = [abs(r["us_predicted"] / r["us_chosen"] - 1) <= 0.25 for r in rows]
    every = [abs(c["predicted"] / c["us"] - 1) <= 0.25 for r in rows for c in r["candidates"].values() if c["us"]]
    return {"points": len(rows) + len(failed), "chosen_failed": len(failed), "within_10pct_of_best": sum(near) / len(rows),
            "worst_vs_dense": max(regret), "slower_than_dense_by_5pct": sum(x > 1.05 for x in regret),
            "predicted_within_25pct": sum(predicted) / len(rows),
            "all_candidates_predicted_within_25pct": sum(every) / len(every),
            "uncalibrated_shape_points": sum(not r["calibrated_shape"] for r in rows)}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    by_impl: dict[str, list] = {}
    for row in result["rows"]:
        for fmt, c in row["candidates"].items():
            if c["us"] is None:
                continue
            by_impl.setdefault(c.get("impl", fmt), []).append((c["us"], c["predicted"]))
    for impl, pairs in sorted(by_impl.items()):
        left.scatter([p[0] for p in pairs], [p[1] for p in pairs], s=8, label=impl, alpha=0.7)
    lo = min(p for pairs in by_impl.values() for pair in pairs for p in pair)
    hi = max(p for pairs in by_impl.values() for pair in pairs for p in pair)
    for factor, style in ((1.0, "k-"), (1.25, "k:"), (0.8, "k:")):
        left.plot([lo, hi], [lo * factor, hi * factor], style, linewidth=0.8)
    left.set(xscale="log", yscale="log", xlabel="measured us", ylabel="predicted us",
             title="every candidate: predicted vs measured (dotted: 25%)")
    left.legend(fontsize=7)
    ratios = sorted(r["us_chosen"] / r["us_best"] for r in result["rows"] if r["us_chosen"])
    right.plot(ratios, [i / len(ratios) for i in range(len(ratios))])
    right.axvline(1.10, color="k", linestyle=":")
    right.set(xlabel="chosen / best measured", ylabel="fraction of points",
              title=f"{result['device']}: choice vs best ({len(ratios)} points)")
    right.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2fx"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--calibration", default="fresh",
                        help="'fresh' (calibrate now, timed), 'cached' (this machine's or the packaged one) or a JSON file")
    parser.add_argument("--quick", action="store_true", help="two shapes only (a smoke run)")
    parser.add_argument("--save-calibration", metavar="FILE", help="also write the calibration used here")
    parser.add_argument("--passes", type=int, default=None,
                        help="time every candidate this many times over the whole grid, keeping the fastest "
                             "(default: 3 on the CPU, whose speed drifts by tens of percent over minutes; 1 on the GPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.passes = args.passes or (3 if args.device == "cpu" else 1)
    result = common.environment("cost_model")
    if args.device == "cpu":
        result["device"] = device_name(device)
    if args.calibration == "fresh":
        start = time.time()
        calibration = calibrate(device)
        result["calibration_s"] = round(time.time() - start, 1)
    elif args.calibration == "cached":
        calibration = calib.for_device(device)
    else:
        calibration = calib.Calibration.from_json(Path(args.calibration).read_text())
    if args.save_calibration:
        Path(args.save_calibration).write_text(calibration.to_json())
    result["calibration"] = {"key": calibration.key, "borrowed": calibration.borrowed,
                             "fits": {name: vars(fit) for name, fit in calibration.fits.items()}}
    calibrated = {(r["n"], r["k"]) for r in calibration.measurements}
    model = CostModel(device, calibration=calibration)      # it times its shortlist, as compile does
    generator = torch.Generator(device).manual_seed(1)
    work = list(points(args.device, args.quick))
    grid_m = GRID[args.device]["M"]
    kept = []                            # the CPU's points, for the later passes
    with tqdm(total=len(work) * len(grid_m), desc="cost-model grid", unit="point") as bar:
        for dtype, n, k, pattern, density in work:
            weight = random_weight(n, k, pattern, density, getattr(torch, dtype), device, generator)
            stats = analyze(weight)
            for m in grid_m:
                row = run_point(model, weight, stats, m, device)
                for c in row["candidates"].values():
                    c["impl"] = c["workload"]["impl"]
                result["rows"].append({"impl": "sparsecc-cost-model", "M": m, "N": n, "K": k, "dtype": dtype,
                                       "epilogue": "none", "density": round(stats.density, 4),
                                       "block": pattern[5:] if pattern.startswith("block") else None,
                                       "us_eager": None, "rel_err": None, "pattern": pattern,
                                       "calibrated_shape": (n, k) in calibrated, **row})
                if args.passes > 1:
                    kept.append((weight, stats, m, result["rows"][-1]))
                bar.update()
            result["summary"] = summarize(result["rows"])
            common.write(result)         # so far (a run cut short keeps what it measured)
    for _ in range(args.passes - 1):     # every candidate timed again, minutes later; the fastest kept
        for weight, stats, m, row in tqdm(kept, desc="cost-model grid, another pass", unit="point"):
            time_candidates(model, weight, stats, m, device, row)
    result["passes"] = args.passes
    result["summary"] = summarize(result["rows"])
    path = common.write(result)
    plot(result, path.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
