"""Batch norm plumbing shared by the BN-folding QAT modules (per-rank or synchronized BN)."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

_M = TypeVar("_M", bound="BnStatsMixin")


class BnStatsMixin:
    """Running-statistics switches of a BN-folding QAT module (one with a ``bn`` child)."""

    bn: Any
    freeze_bn: bool

    def reset_running_stats(self) -> None:
        self.bn.reset_running_stats()

    def update_bn_stats(self: _M) -> _M:
        """Let batch norm learn running statistics again (it trains with the module)."""
        self.freeze_bn = False
        self.bn.training = True
        return self

    def freeze_bn_stats(self: _M) -> _M:
        """Freeze batch norm: running statistics stop changing, even in train mode."""
        self.freeze_bn = True
        self.bn.training = False
        return self


def make_bn(
    kind: type[nn.Module], num_features: int, eps: float, momentum: float | None
) -> nn.Module:
    """An affine, statistics-tracking batch norm of ``kind``."""
    return kind(num_features, eps, momentum, True, True)


def adopt_bn(qat: Any, bn: Any) -> None:
    """Share ``bn``'s parameters and statistics with ``qat.bn``.

    A SyncBatchNorm source keeps its kind (and process group), so statistics stay
    synchronized across ranks after the swap to QAT.
    """
    if isinstance(bn, nn.SyncBatchNorm) and not isinstance(qat.bn, nn.SyncBatchNorm):
        current = qat.bn
        sync = nn.SyncBatchNorm(
            current.num_features,
            current.eps,
            current.momentum,
            True,
            True,
            process_group=bn.process_group,
        )
        sync.training = current.training
        qat.bn = sync
    target = qat.bn
    target.weight = bn.weight
    target.bias = bn.bias
    target.running_mean = bn.running_mean
    target.running_var = bn.running_var
    target.num_batches_tracked = bn.num_batches_tracked
