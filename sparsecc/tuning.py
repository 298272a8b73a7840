"""Which launch (kernel tiling plus scheduler knobs) runs a GEMM fastest on this GPU.

``benchmarks/kernels.py`` measures every candidate launch on a grid of shapes and batch sizes
and writes the winners; ``sparsecc/tuning.json`` holds the table for the GPU it was measured
on. A weight of an unmeasured shape uses the winner at the nearest measured shape (log
distance in N and K) for each batch-size bucket; a dtype without entries borrows the other
16-bit dtype's (the same tensor-core path).
"""
from __future__ import annotations

import importlib.resources
import json
import math
from functools import lru_cache

from .codegen import Family, KernelSpec

TABLE = "tuning.json"


_override: dict | None = None


@lru_cache(maxsize=1)
def _packaged() -> dict:
    resource = importlib.resources.files("sparsecc") / TABLE
    if not resource.is_file():
        return {"entries": []}
    return json.loads(resource.read_text())


def table() -> dict:
    """The tuning table in use: one set with :func:`use`, else the packaged one."""
    return _override if _override is not None else _packaged()


def use(new_table: dict | None) -> None:
    """Use ``new_table`` (e.g. one just measured) for this process; None restores the packaged one."""
    global _override
    _override = new_table


def best_entry(family: Family, dtype: str, m: int, out_features: int, in_features: int):
    """``(launch, microseconds)`` of the measured best launch at the nearest measured shape with
    this M, or None: the time lets families measured in one sweep be compared. The nearest shape
    counts, not the dtype: fp16 and bf16 launches of one tiling run within a few percent of each
    other (benchmarks/decode.py, kernels.py), while a tiling borrowed from a shape four times the
    weight can leave half the SMs idle; at the same shape this dtype's own entry wins. A
    tensor-core small-batch launch borrowed from another shape keeps its tiling but not its
    cluster size, which depends on the shape (:attr:`Family.clustered`): the kernel picks that."""
    from .gpu import Launch
    entries = [e for e in table()["entries"] if e["family"] == family.value and e["M"] == m]
    if not entries:
        return None

    def distance(entry):
        return (math.log(entry["N"] / out_features) ** 2 + math.log(entry["K"] / in_features) ** 2,
                entry["dtype"] != dtype)

    best = min(entries, key=distance)
    spec = dict(best["spec"], dtype=dtype)
    splits = best["splits"]
    if family.clustered and (best["N"], best["K"]) != (out_features, in_features):
        splits = 0           # blocks per cluster measured for another shape: the kernel picks for this one
    return Launch(KernelSpec(**spec), swizzle=best["swizzle"], splits=splits), best["us"]


#: the relative error against the fp32 reference above which a benchmark row's launch computed
#: a wrong result and never becomes a tuning entry, however fast
MAX_REL_ERR = {"float16": 3e-3, "bfloat16": 1e-2}


def computed_right(row: dict) -> bool:
    """Whether a benchmark row's launch computed the right result: its ``rel_err`` was measured
    and is within :data:`MAX_REL_ERR` for its dtype."""
    return row.get("rel_err") is not None and row["rel_err"] <= MAX_REL_ERR.get(row["dtype"], 0.0)


def winners(rows: list[dict], impls=("sparsecc-config",)) -> list[dict]:
    """Tuning entries from benchmark rows of these impls (each with its ``launch``): per
    (family, dtype, M, N, K), the fastest launch whose result was right (``rel_err`` within
    :data:`MAX_REL_ERR`)."""
    best: dict[tuple, dict] = {}
    for row in rows:
        if row.get("impl") not in impls or not row.get("us") or not computed_right(row):
            continue
        key = (row["launch"]["spec"]["family"], row["dtype"], row["M"], row["N"], row["K"])
        if key not in best or row["us"] < best[key]["us"]:
            best[key] = {"family": key[0], "dtype": key[1], "M": key[2], "N": key[3], "K": key[4],
                         "us": row["us"], **row["launch"]}
    return list(best.values())
