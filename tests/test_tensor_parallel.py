"""Tensor parallelism: a pruned Llama sharded over two CPU processes (gloo) with torch's
``parallelize_module`` and compiled by sparsecc on both ranks runs 2:4 on each rank's local shards,
computes what the unsharded eager model computes, and both ranks run the same plan. The ranks run
this file under torchrun (``worker``); the tests read what each rank wrote. Also the pieces on
their own: shard layouts, the worst case of several shards' statistics, the plan's note."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import sparsecc
from sparsecc.frontend.sharded import LocalShard, ShardLayout
from sparsecc.ir.analysis import analyze, worst_of
from sparsecc.ir.formats import FormatSpec
from sparsecc.planner.shared import shard_note

ROOT = Path(__file__).resolve().parent.parent
#: relative error allowed against the unsharded fp32 eager model
TOLERANCE = 1e-4


def torchrun(args: list[str], tmp_path: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    torchrun([__file__, str(out)], out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_sharded_compiled_llama_matches_the_unsharded_eager_one(ranks):
    for result in ranks:
        assert result["sparsecc"].endswith(str(Path("sparsecc", "__init__.py")))
        assert str(ROOT) in result["sparsecc"]
        assert result["rel_err"] < TOLERANCE, result
        assert result["rel_err_sharded_eager"] < TOLERANCE       # the sharding itself is exact too


def test_every_shard_runs_2_4_and_both_ranks_run_the_same_plan(ranks):
    plans = [r["choices"] for r in ranks]
    assert plans[0] == plans[1]
    assert len(plans[0]) == 14 and set(plans[0].values()) == {"2:4"}          # 2 layers x 7 projections
    for result in ranks:
        assert result["packed_ops"] == 14, result                # each local shard runs its packed op
        assert all(name in result["gathered"] for name in plans[0])
        assert result["gathered"] == plans[0]                    # what the other rank said it runs


def test_the_plan_says_where_each_shard_lies(ranks):
    for rank, result in enumerate(ranks):
        reason = result["reasons"]["layers.0.mlp.down_proj"]
        assert "planned on rank 0 for the shards of all 2 ranks" in reason
        assert f"rank {rank} runs columns {64 * rank}:{64 * (rank + 1)} of the [64, 128] weight" in reason
        assert "inside" not in reason                            # 64-column shards keep the groups of 4 whole


def test_a_shard_boundary_inside_groups_of_four_is_said_and_stays_exact(ranks):
    for result in ranks:
        cut = result["cut"]
        assert cut["rel_err"] < TOLERANCE
        assert "its boundary falls inside groups of 4 along K (2:4)" in cut["reasons"]["2"], cut
        assert "inside" not in cut["reasons"]["0"]               # a column-wise split keeps K whole
    assert ranks[0]["cut"]["choices"] == ranks[1]["cut"]["choices"]


def test_a_weight_changed_after_compile_is_refused_on_every_rank(ranks):
    assert all("changed after sparsecc.compile" in r["stale_error"] for r in ranks)


def test_the_benchmark_runs_on_two_cpu_processes(tmp_path):
    out = tmp_path / "tp.json"
    torchrun([str(ROOT / "benchmarks" / "tensor_parallel.py"), "--device", "cpu", "--tiny", "--layers", "1",
              "--compile-mode", "none", "--prompt", "8", "--new-tokens", "2", "--batches", "1", "--repeats", "1",
              "--patterns", "2:4", "--force-formats", "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["bench"] == "tensor_parallel"
    assert {r["impl"] for r in result["rows"]} == {"dense", "sparsecc"}
    sparse = next(r for r in result["rows"] if r["impl"] == "sparsecc")
    assert sparse["choices"]["2:4"] == 7 and sparse["tokens_per_s"] > 0


@pytest.mark.parametrize("dim, offset, size, cut", [(1, 0, 64, False), (1, 64, 64, False), (1, 6, 6, True),
                                                    (0, 6, 6, False)])
def test_a_layout_knows_whether_it_cuts_groups_along_k(dim, offset, size, cut):
    shape = (size, 12) if dim == 0 else (12, size)
    full = (max(offset + size, 12), 12) if dim == 0 else (12, max(offset + size, 12))
    layout = ShardLayout(dim=dim, ranks=2, rank=1, full_shape=full, shape=shape,
                         offset=(offset, 0) if dim == 0 else (0, offset))
    assert layout.cuts(group_along_k=4) is cut


def test_a_layout_knows_whether_it_cuts_blocks():
    rows = ShardLayout(dim=0, ranks=2, rank=1, full_shape=(96, 128), shape=(48, 128), offset=(48, 0))
    assert rows.cuts(block=(64, 64)) and not rows.cuts(block=(16, 16))
    assert "inside 64x64 blocks (bsr64x64)" in shard_note(rows, [FormatSpec.parse("bsr64x64")])
    assert "inside" not in shard_note(rows, [FormatSpec.parse("bsr16x16"), FormatSpec.parse("2:4")])


def test_the_worst_of_several_shards_fits_only_what_fits_each():
    torch.manual_seed(0)
    sparse = torch.randn(8, 16) * (torch.arange(16) % 4 < 2)             # 2:4
    denser = torch.randn(8, 16) * (torch.arange(16) % 4 < 3)             # 3:4
    merged = worst_of([analyze(sparse), analyze(denser)])
    assert not merged.fits(FormatSpec.parse("2:4")) and merged.fits(FormatSpec.parse("3:4"))
    assert merged.nnz == analyze(denser).nnz
    assert worst_of([analyze(sparse)] * 2).fits(FormatSpec.parse("2:4"))


# ----------------------------------------------------------------------------- the ranks' side

def _llama():
    hf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = hf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, use_cache=False)
    return hf.LlamaModel(config).eval()


def _rel(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _packed_ops(compiled: nn.Module) -> int:
    ops = 0
    for module in compiled.modules():
        if isinstance(module, LocalShard) and isinstance(module.local, torch.fx.GraphModule):
            ops += sum(n.op == "call_function" and "linear_nm" in str(n.target) for n in module.local.graph.nodes)
    return ops


def worker(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    model = _llama()
    sparsecc.prune(model, "2:4", exclude=["*embed*"])
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).last_hidden_state
    plan = {}
    for i in range(2):
        plan.update({f"layers.{i}.{n}": ColwiseParallel() for n in
                     ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")})
        plan.update({f"layers.{i}.{n}": RowwiseParallel() for n in ("self_attn.o_proj", "mlp.down_proj")})
    parallelize_module(model, mesh, plan)
    compiled = sparsecc.compile(model, ids, formats=("2:4",))
    with torch.no_grad():
        got = compiled(ids).last_hidden_state
        sharded_eager = model(ids).last_hidden_state
    choices = {s.label: s.choice for s in compiled.sparsecc_plan}
    gathered = [None, None]
    dist.all_gather_object(gathered, choices)
    result = {"sparsecc": sparsecc.__file__, "rel_err": _rel(got, want), "rel_err_sharded_eager": _rel(sharded_eager, want),
              "choices": choices, "gathered": gathered[1 - rank], "packed_ops": _packed_ops(compiled),
              "reasons": {s.label: s.reason for s in compiled.sparsecc_plan}, "cut": _cut_groups(mesh)}
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight.mul_(2.0)
    try:
        compiled(ids)
        result["stale_error"] = ""
    except sparsecc.SparseccError as error:
        result["stale_error"] = str(error)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _cut_groups(mesh) -> dict:
    """An MLP whose row-wise layer has K = 12: the shards' columns 0:6 and 6:12 cut the second
    group of 4; the full weight is pruned 2:4, each shard is analysed on its own."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8)).eval()
    sparsecc.prune(model, "2:4")
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = model(x)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    with torch.no_grad():
        got = compiled(x)
    return {"rel_err": _rel(got, want), "choices": {s.label: s.choice for s in compiled.sparsecc_plan},
            "reasons": {s.label: s.reason for s in compiled.sparsecc_plan}}


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
