"""Pattern forms, their validation and the sequential <-> complex conversions."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from quantbridge.patterns import (
    MatchAllNode,
    PatternError,
    check_complex_pattern,
    check_sequential_pattern,
    complex_to_sequential,
    pattern_operators,
    sequential_to_complex,
)

OPS = [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, F.relu, torch.add, operator.add, "relu", "view"]


def test_two_and_three_tuples_like_torch_ao_backend_configs() -> None:
    pytest.importorskip("torch.ao.quantization")
    import torch.ao.quantization.backend_config.utils  # noqa: F401
    from torch.ao.quantization.backend_config import (
        get_executorch_backend_config,
        get_native_backend_config,
        get_onednn_backend_config,
        get_qnnpack_backend_config,
    )
    from torch.ao.quantization.backend_config.utils import (
        _get_pattern_in_reversed_nested_tuple_format,
    )

    checked = 0
    configs = (
        get_native_backend_config(),
        get_qnnpack_backend_config(),
        get_onednn_backend_config(),
        get_executorch_backend_config(),
    )
    for config in configs:
        for pattern_config in config.configs:
            if pattern_config.pattern is None:
                continue
            expected = _get_pattern_in_reversed_nested_tuple_format(pattern_config)
            assert sequential_to_complex(pattern_config.pattern) == expected
            assert complex_to_sequential(expected) == pattern_config.pattern
            checked += isinstance(pattern_config.pattern, tuple)
    assert checked > 50


def test_explicit_conversions() -> None:
    assert sequential_to_complex(nn.Linear) is nn.Linear
    assert sequential_to_complex((nn.Linear, nn.ReLU)) == (nn.ReLU, nn.Linear)
    assert sequential_to_complex((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)) == (
        nn.ReLU,
        (nn.BatchNorm2d, nn.Conv2d),
    )
    assert sequential_to_complex(("view", F.relu, torch.add, nn.ReLU)) == (
        nn.ReLU,
        (torch.add, (F.relu, "view")),
    )
    assert sequential_to_complex((nn.ReLU,)) is nn.ReLU


@given(st.lists(st.sampled_from(OPS), min_size=2, max_size=8))
def test_round_trip_any_length(chain: list[object]) -> None:
    seq = tuple(chain)
    cplx = sequential_to_complex(seq)
    assert complex_to_sequential(cplx) == seq
    # operators in pre-order are the chain reversed (anchor first)
    assert pattern_operators(cplx) == list(reversed(seq))


def test_complex_to_sequential_refuses_non_chains() -> None:
    with pytest.raises(PatternError, match="not a chain"):
        complex_to_sequential((torch.add, nn.Conv2d, nn.Conv2d))
    with pytest.raises(PatternError, match="MatchAllNode"):
        complex_to_sequential((nn.ReLU, MatchAllNode))


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        (3, "pattern"),
        ((nn.Conv2d, 3), r"pattern\[1\]"),
        ((), "empty"),
        (nn.Conv2d(1, 1, 1), "pattern"),
        ("", "pattern"),
        (torch.float32, "pattern"),
    ],
)
def test_sequential_validation_names_the_culprit(bad: object, where: str) -> None:
    with pytest.raises(PatternError, match=where):
        check_sequential_pattern(bad)
    with pytest.raises(PatternError):
        sequential_to_complex(bad)


def test_complex_validation() -> None:
    check_complex_pattern((nn.ReLU, (torch.add, nn.Conv2d, MatchAllNode)))
    with pytest.raises(PatternError, match=r"pattern\[1\]\[2\].*not a pattern element"):
        check_complex_pattern((nn.ReLU, (torch.add, nn.Conv2d, 1.0)))
    with pytest.raises(PatternError, match="first item"):
        check_complex_pattern(((nn.ReLU, nn.Conv2d), nn.Conv2d))
    with pytest.raises(PatternError, match="nested"):
        check_sequential_pattern((nn.Conv2d, (nn.ReLU,)))
    # PatternError is a ValueError, so generic callers can catch it
    assert issubclass(PatternError, ValueError)
