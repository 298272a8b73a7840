"""benchmarks/kernels_gemm.py's and decode.py's command lines on the CPU: ``--shapes`` takes NxK weight
shapes and refuses what the 2:4 kernels cannot take, naming it; the two one-sided modes exclude
each other."""
import argparse
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")


if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)          # last: for the modules only it has (kernels_gemm, decode, common)
kernels = importlib.import_module("kernels_gemm")
decode = importlib.import_module("decode")


def test_shapes_parse_as_out_by_in_features():
    assert kernels.shape("4096x1024") == (4096, 1024)
    assert kernels.shape("512X2048") == (512, 2048)


@pytest.mark.parametrize("text", ["4096", "4096x1024x8", "ax16", "0x64", "64x100"])
def test_bad_shapes_are_refused_by_name(text):
    with pytest.raises(argparse.ArgumentTypeError, match=text):
        kernels.shape(text)


def test_dense_only_and_sparse_only_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        kernels.main(["--dense-only", "--sparse-only", "--shapes", "64x64"])
    assert "exclude each other" in capsys.readouterr().err


def test_decode_takes_a_models_shapes_and_refuses_bad_ones(capsys):
    with pytest.raises(SystemExit):
        decode.main(["--shapes", "2048x2048", "64x100"])
    assert "64x100" in capsys.readouterr().err
