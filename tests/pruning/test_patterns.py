import pytest
from hypothesis import given, settings, strategies as st

from sparsecc.errors import PatternError
from sparsecc.ir.formats import FormatSpec
from sparsecc.pruning.patterns import (BlockNMPattern, BlockPattern, NMPattern, Pattern,
                                       UnstructuredPattern, VectorNMPattern, parse_pattern)


@st.composite
def n_and_m(draw):
    m = draw(st.integers(2, 256))
    return draw(st.integers(1, m - 1)), m


densities = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False).filter(lambda d: d > 0)
patterns = st.one_of(
    n_and_m().map(lambda nm: NMPattern(*nm)),
    st.tuples(n_and_m(), st.integers(1, 64)).map(lambda a: VectorNMPattern(*a[0], a[1])),
    st.tuples(n_and_m(), st.integers(1, 128)).map(lambda a: BlockNMPattern(*a[0], a[1])),
    st.builds(BlockPattern, st.integers(1, 128), st.integers(1, 128), densities),
    st.builds(UnstructuredPattern, densities),
)


@settings(max_examples=200, deadline=None)
@given(patterns)
def test_string_round_trips(pattern):
    text = str(pattern)
    assert parse_pattern(text) == pattern
    assert type(pattern).parse(text) == pattern
    assert str(parse_pattern(text)) == text
    # case and spaces do not matter
    assert parse_pattern("  " + " ".join(text.upper())) == pattern


@pytest.mark.parametrize("text, expected", [
    ("2:4", NMPattern(2, 4)), ("1:4", NMPattern(1, 4)), ("4:8", NMPattern(4, 8)),
    ("3:32", NMPattern(3, 32)), ("2:4/vw4", VectorNMPattern(2, 4, 4)),
    ("2:4/bw32", BlockNMPattern(2, 4, 32)), ("block32x32@0.25", BlockPattern(32, 32, 0.25)),
    ("block16x64@0.5", BlockPattern(16, 64, 0.5)), ("block16@0.5", BlockPattern(16, 16, 0.5)),
    ("unstructured@0.1", UnstructuredPattern(0.1)), ("unstructured@1", UnstructuredPattern(1.0)),
])
def test_parses_each_syntax(text, expected):
    assert parse_pattern(text) == expected
    assert parse_pattern(expected) is expected          # objects pass through


@pytest.mark.parametrize("pattern, density", [("2:4", 0.5), ("3:32", 3 / 32), ("2:4/vw4", 0.5),
                                              ("1:4/bw8", 0.25), ("block8x4@0.3", 0.3),
                                              ("unstructured@0.05", 0.05)])
def test_density(pattern, density):
    assert parse_pattern(pattern).density == pytest.approx(density)


def test_each_class_parses_only_its_own_syntax():
    assert isinstance(NMPattern.parse("2:4"), NMPattern)
    assert isinstance(Pattern.parse("2:4/vw4"), VectorNMPattern)
    with pytest.raises(PatternError, match="VectorNMPattern, not a NMPattern"):
        NMPattern.parse("2:4/vw4")
    with pytest.raises(PatternError, match="not a BlockPattern"):
        BlockPattern.parse("unstructured@0.5")


@pytest.mark.parametrize("text, says", [
    ("2-4", "'n:m'"), ("two:four", "'n:m'"), ("2:4/xw4", "does not parse"), ("", "does not parse"),
    ("4:4", "n < m"), ("5:4", "n < m"), ("0:4", "n >= 1"), ("0:4", "'1:4'"),
    ("4:4", "write e.g. '2:4'"),
    ("unstructured@0", "keeps nothing"), ("unstructured@-0.1", "does not parse|keeps nothing"),
    ("unstructured@90", "for 90% sparsity write @0.1"), ("unstructured@1.5", r"\(0, 1\]"),
    ("unstructured@abc", "not a number"), ("unstructured@nan", r"\(0, 1\]"),
    ("block32x32@2", r"\(0, 1\]"), ("block0x32@0.5", ">= 1"), ("2:4/vw0", ">= 1"),
    ("2:4/bw0", ">= 1"),
])
def test_bad_strings_say_what_to_write(text, says):
    with pytest.raises(PatternError, match=says):
        parse_pattern(text)


@pytest.mark.parametrize("make", [
    lambda: NMPattern(4, 4), lambda: NMPattern(0, 4), lambda: NMPattern(2.0, 4),
    lambda: NMPattern(True, 4), lambda: VectorNMPattern(2, 4, 0), lambda: BlockNMPattern(1, 2, -1),
    lambda: BlockPattern(4, 4, 0.0), lambda: BlockPattern(4, 4, 1.01), lambda: BlockPattern(0, 4, 0.5),
    lambda: UnstructuredPattern(float("inf")), lambda: UnstructuredPattern("0.5"),
])
def test_construction_validates(make):
    with pytest.raises(PatternError):
        make()


def test_non_string_is_refused_with_the_syntax():
    with pytest.raises(PatternError, match="unstructured@"):
        parse_pattern(0.5)


def test_density_is_stored_as_float():
    assert isinstance(BlockPattern(4, 4, 1).density, float)
    assert str(UnstructuredPattern(1)) == "unstructured@1.0"


@pytest.mark.parametrize("pattern, shape", [("2:4/bw32", (64, 96)), ("2:4/bw4", (4, 4)),
                                            ("block16x8@0.5", (32, 24)), ("2:4", (3, 5)),
                                            ("2:4/vw4", (5, 7)), ("unstructured@0.5", (1, 1))])
def test_check_shape_accepts(pattern, shape):
    parse_pattern(pattern).check_shape(shape)


@pytest.mark.parametrize("pattern, shape", [("2:4/bw32", (10, 128)), ("2:4/bw32", (64, 100)),
                                            ("block16x8@0.5", (32, 20)), ("block16x8@0.5", (8, 8))])
def test_check_shape_refuses_blocks_that_do_not_divide(pattern, shape):
    with pytest.raises(PatternError, match=f"{shape[0]}x{shape[1]}"):
        parse_pattern(pattern).check_shape(shape)


@pytest.mark.parametrize("pattern, formats", [
    ("2:4", ["2:4"]), ("2:4/vw4", ["2:4"]), ("1:4/bw8", ["8:32", "bsr8x8"]),
    ("block16x32@0.5", ["bsr16x32"]), ("unstructured@0.5", ["csr"])])
def test_formats_the_pruned_weight_fits(pattern, formats):
    assert parse_pattern(pattern).formats() == tuple(FormatSpec.parse(f) for f in formats)
