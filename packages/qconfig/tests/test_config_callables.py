"""The classes from_json may construct to check a config's arguments."""

from __future__ import annotations

import quantbridge.qconfig as qconfig
from quantbridge.qconfig._config_callables import CONSTRUCTIBLE, is_registered

# Written out by hand: CONSTRUCTIBLE is derived from the modules, this is what it must give.
EXPECTED = {
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "PerGroupMinMaxObserver",
    "PerGroupGPTQObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "HistogramObserver",
    "PercentileObserver",
    "EntropyObserver",
    "PlaceholderObserver",
    "FixedQParamsObserver",
    "NoopObserver",
    "ReuseInputObserver",
    "RecordingObserver",
    "FakeQuantize",
    "FixedQParamsFakeQuantize",
    "FusedMovingAvgObsFakeQuantize",
}


def test_constructible_is_every_public_concrete_observer_and_fake_quantize() -> None:
    assert {cls.__name__ for cls in CONSTRUCTIBLE} == EXPECTED
    # The public names are these very classes (no base class or private helper slipped in).
    assert {getattr(qconfig, name) for name in EXPECTED} == CONSTRUCTIBLE


def test_constructible_classes_and_default_factories_are_registered() -> None:
    assert all(is_registered(cls) for cls in CONSTRUCTIBLE)
    assert is_registered(qconfig.default_observer)
    assert not is_registered(qconfig.ObserverBase)
