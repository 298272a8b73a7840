"""benchmarks/kernels.py's and decode.py's command lines on the CPU: ``--shapes`` takes NxK weight
shapes and refuses what the 2:4 kernels cannot take, naming it; the two one-sided modes exclude
each other."""
import argparse
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")


def _import_benchmarks(*names):
    """benchmarks/NAME.py for each name. ``kernels`` also names the tests' package tests/kernels
    (tests/ is on sys.path): while the benchmarks import (decode imports kernels), benchmarks/
    comes first and the names are theirs; afterwards sys.modules holds what it held, and
    benchmarks/ is last on sys.path (for the modules only it has, e.g. common)."""
    path, held = list(sys.path), {name: sys.modules.pop(name, None) for name in names}
    sys.path.insert(0, BENCHMARKS)
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path[:] = [entry for entry in path if entry != BENCHMARKS] + [BENCHMARKS]
        for name, module in held.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


kernels, decode = _import_benchmarks("kernels", "decode")


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
