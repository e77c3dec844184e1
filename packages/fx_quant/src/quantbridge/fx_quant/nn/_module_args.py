"""Constructor arguments and parameter copies shared by the QAT, fused and reference modules.

Each module family rebuilds its float counterpart (``from_float``/``to_float``) from the same
attributes; these helpers read them in the constructor's positional order in one place.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# Fixed-length, so that type checkers can match the unpacked arguments to parameters.
_Args5 = tuple[Any, Any, Any, Any, Any]
_Args9 = tuple[Any, Any, Any, Any, Any, Any, Any, Any, Any]
_Args10 = tuple[Any, Any, Any, Any, Any, Any, Any, Any, Any, Any]


def conv_args(conv: Any) -> _Args9:
    """``nn.ConvNd``'s positional arguments, in/out channels to ``padding_mode``, of ``conv``."""
    return (
        conv.in_channels,
        conv.out_channels,
        conv.kernel_size,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups,
        conv.bias is not None,
        conv.padding_mode,
    )


def conv_transpose_args(conv: Any) -> _Args10:
    """``nn.ConvTransposeNd``'s positional arguments, in/out channels to ``padding_mode``."""
    return (
        conv.in_channels,
        conv.out_channels,
        conv.kernel_size,
        conv.stride,
        conv.padding,
        conv.output_padding,
        conv.groups,
        conv.bias is not None,
        conv.dilation,
        conv.padding_mode,
    )


def embedding_options(emb: Any) -> _Args5:
    """``padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse`` of an nn.Embedding.

    The order of both ``nn.Embedding(num, dim, *options, _weight)`` and
    ``F.embedding(input, weight, *options)``.
    """
    return (emb.padding_idx, emb.max_norm, emb.norm_type, emb.scale_grad_by_freq, emb.sparse)


def embedding_bag_args(bag: Any, weight: Any) -> _Args10:
    """``nn.EmbeddingBag``'s positional arguments for ``bag``, with ``_weight=weight``."""
    return (
        bag.num_embeddings,
        bag.embedding_dim,
        bag.max_norm,
        bag.norm_type,
        bag.scale_grad_by_freq,
        bag.mode,
        bag.sparse,
        weight,
        bag.include_last_offset,
        bag.padding_idx,
    )


def copy_parameters(dst: nn.Module, src: nn.Module, names: tuple[str, ...]) -> None:
    """Give ``dst`` detached copies (new Parameters) of ``src``'s parameters that are set."""
    for name in names:
        value = getattr(src, name)
        if value is not None:
            setattr(dst, name, nn.Parameter(value.detach()))


def float_with_relu(qat: Any, float_module: nn.Module) -> nn.Module:
    """``float_module`` (wrapped with a ReLU if ``qat`` is fused with one) in ``qat``'s mode."""
    result = float_module
    if qat._FLOAT_RELU_MODULE is not None and qat._FUSED_FLOAT_MODULE is not None:
        result = qat._FUSED_FLOAT_MODULE(float_module, qat._FLOAT_RELU_MODULE())
    result.train(qat.training)
    return result
