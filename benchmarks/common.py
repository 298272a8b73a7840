"""What every benchmark shares: timing (CUDA events through triton's do_bench, median, as a
CUDA-graph replay and as an eager call), the relative error (sparsecc's own,
:func:`sparsecc.ir.numerics.relative_error`), the shipped dispatch pinned (:func:`fixed_dispatch`),
the environment header and the results file."""
from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

import sparsecc
from sparsecc.ir.numerics import relative_error

RESULTS = Path(__file__).resolve().parent / "results"

#: what the benchmarks import from here, the relative error among them: sparsecc's own
#: (||got - want|| / ||want||, float64), the one compile's check and the tests use
__all__ = ["RESULTS", "relative_error", "fixed_dispatch", "private_tuning", "environment", "rotating", "time_eager_us",
           "time_graph_us", "write", "bar_chart", "plot_per_dtype", "plot_generation_speedups"]


def fixed_dispatch() -> None:
    """Measure the launches of the shipped tuning table (sparsecc/kernels/tuning.json), the
    same on every run and machine: ``SPARSECC_TUNE=off`` (nothing is tuned, and nothing is
    written to the per-machine table), and the per-machine table's entries, which
    SPARSECC_TUNE=off still reads, left out for this process. Benchmarks that time sparsecc's
    dispatch against competitors call it first when run as scripts (not when imported)."""
    from sparsecc.kernels import tune
    os.environ["SPARSECC_TUNE"] = "off"
    tune.use(tune.TuningTable(tune.shipped_entries()))


def private_tuning(bench: str) -> None:
    """Tune as ``sparsecc.compile`` does on a user's machine (``SPARSECC_TUNE=new``: each shape's
    batches measured the first time a plan needs them), into a table of this run's own that
    starts from the shipped one: the per-machine table is neither read nor written, so earlier
    tuning hides nothing and the product's tables stay as they were."""
    from sparsecc.kernels import tune
    os.environ["SPARSECC_TUNE"] = "new"
    tune.use(tune.TuningTable(tune.shipped_entries(), Path(tempfile.mkdtemp()) / "tuning.json", bench))


def environment(bench: str) -> dict:
    cuda = torch.cuda.is_available()
    return {"bench": bench, "device": torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu"),
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "sparsecc": sparsecc.__version__, "tune": os.environ.get("SPARSECC_TUNE", "new"),
            "date": datetime.date.today().isoformat(), "rows": []}


def rotating(call, *tensors, nbytes: int | None = None, max_copies: int | None = None):
    """A no-argument function running ``call(*copy)`` over copies of ``tensors`` in turn, and
    the number of copies: enough that ``nbytes`` (default: the tensors' bytes) per copy add up
    to sparsecc.runtime.timing.ROTATE_BYTES, so each call reads its weight from memory, not the L2."""
    from sparsecc.runtime.timing import MAX_COPIES, copies_for
    nbytes = nbytes if nbytes is not None else sum(t.numel() * t.element_size() for t in tensors)
    copies = copies_for(nbytes, max_copies or MAX_COPIES)
    sets = [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]
    turn = itertools.cycle(sets)
    return (lambda: call(*next(turn))), copies


def time_eager_us(fn, *, warmup_ms=10, rep_ms=40) -> float:
    """Median microseconds of ``fn()`` called eagerly (host overhead included)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def time_graph_us(fn, *, calls=10, warmup_ms=10, rep_ms=40) -> float:
    """Median microseconds per call of ``fn`` captured ``calls`` times in one CUDA graph and
    replayed: kernel time without host overhead."""
    import triton.testing
    from sparsecc.runtime.timing import capture_graph
    fn()                                  # warm up outside capture (module loads, handles)
    graph = capture_graph(fn, calls)
    return triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3 / calls


def failed(row: dict, error: Exception) -> None:
    """Record in ``row`` that its implementation raised ``error``: no times, the error's first 300
    characters (a benchmark goes on with the other implementations)."""
    row.update(us=None, us_eager=None, rel_err=None, error=f"{type(error).__name__}: {error}"[:300])


def write(result: dict, *, stem: str | None = None) -> Path:
    """Write ``result`` to benchmarks/results/<bench>-<gpu>-<date>.json and return the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    gpu = result["device"].replace(" ", "_").replace("/", "_")
    path = RESULTS / f"{stem or result['bench']}-{gpu}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


def bar_chart(result: dict, path, key: str, *, xlabel: str, title: str) -> None:
    """One horizontal bar per row of ``result`` (its ``impl``), the bar ``row[key]``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(result["rows"]) + 1.5))
    ax.barh([r["impl"] for r in result["rows"]], [r[key] for r in result["rows"]])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(f"{title}, {result['device']}, torch {result['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_per_dtype(result: dict, path, draw, *, xlabel: str, title: str) -> None:
    """One log-log panel per dtype of ``result``: ``draw(ax, dtype)`` plots the curves, this
    adds the 1.0 line, the labels and the environment, and saves the figure to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dtypes = sorted({r["dtype"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 5), sharey=True, squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        draw(ax, dtype)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(f"{dtype}: {title}")
    axes[0][0].set_ylabel("speedup")
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(f"{result['device']}, torch {result['torch']}, CUDA {result['cuda']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_generation_speedups(result: dict, path, case_of, label_of, *, first_label: str, title: str) -> None:
    """Per case (``case_of(row)``, labelled ``label_of(case)``), sparsecc's speedup over dense in
    the time to the first token (``ttft_ms``, drawn as ``first_label``) and in decode tokens per
    second (``tokens_per_s``), one bar pair per impl beside dense (labelled with its impl where it is
    not ``sparsecc``); cases without a dense row are left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pairs = {}
    for row in result["rows"]:
        pairs.setdefault(case_of(row), {})[row["impl"]] = row
    labels, first, decode = [], [], []
    for case, rows in pairs.items():
        dense = rows.get("dense")
        for impl, sparse in rows.items():
            if dense is None or impl == "dense":
                continue
            labels.append(label_of(case) + ("" if impl == "sparsecc" else f"\n{impl}"))
            first.append(dense["ttft_ms"] / sparse["ttft_ms"])
            decode.append(sparse["tokens_per_s"] / dense["tokens_per_s"]
                          if sparse["tokens_per_s"] and dense["tokens_per_s"] else 0)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], first, 0.4, label=first_label)
    ax.bar([i + 0.2 for i in x], decode, 0.4, label="decode tokens/s")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("sparsecc speedup over dense")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
