"""uint8 conv input (NCHW or channels-last) → the zero-point-padded channels-last buffer.

numpy's transposing copy moves ~3 bytes per ns here; the conv kernels then wait on it (60 µs
of a 620 µs 64-channel 56x56 conv). The copy below moves 16x16 byte tiles through vector
registers: 16 row loads, four rounds of byte interleaves (the perfect shuffle, applied
log2(16) times, transposes a 16x16 matrix), 16 row stores. The IR uses only generic vector
loads, ``shufflevector`` and stores, so it compiles for any CPU LLVM targets (SSE2
``punpck*`` on x86-64) and serves every kernel target.

Edges narrower than a tile are handled by an overlapping last tile (rewriting bytes with the
same values); dimensions under 16 fall back to scalar loops.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

TILE = 16
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_V16 = ir.VectorType(_I8, TILE)


def _interleave(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, high: bool) -> ir.Value:
    half = TILE // 2
    base = half if high else 0
    mask = [v for i in range(half) for v in (base + i, TILE + base + i)]
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, TILE), mask))


def _transpose_tile(
    typingctx: Any, src: Any, src_off: Any, src_stride: Any, dst: Any, dst_off: Any, dst_stride: Any
) -> Any:
    """``dst[dst_off + c*dst_stride + r] = src[src_off + r*src_stride + c]`` for r, c < 16.

    The caller guarantees every addressed byte lies inside both flat uint8 arrays.
    """
    sig = types.void(src, src_off, src_stride, dst, dst_off, dst_stride)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> ir.Value:
        s_arr, s_off, s_stride, d_arr, d_off, d_stride = args
        s_ptr = context.make_array(signature.args[0])(context, builder, s_arr).data
        d_ptr = context.make_array(signature.args[3])(context, builder, d_arr).data
        rows = []
        for r in range(TILE):
            at = builder.add(s_off, builder.mul(s_stride, ir.Constant(s_stride.type, r)))
            v = builder.load(builder.bitcast(builder.gep(s_ptr, [at]), _V16.as_pointer()))
            v.align = 1
            rows.append(v)
        for _ in range(4):
            half = TILE // 2
            nxt = []
            for i in range(half):
                nxt.append(_interleave(builder, rows[i], rows[i + half], False))
                nxt.append(_interleave(builder, rows[i], rows[i + half], True))
            rows = nxt
        for c in range(TILE):
            at = builder.add(d_off, builder.mul(d_stride, ir.Constant(d_stride.type, c)))
            ptr = builder.bitcast(builder.gep(d_ptr, [at]), _V16.as_pointer())
            st = builder.store(rows[c], ptr)
            st.align = 1
        return context.get_dummy_value()

    return sig, codegen


# typed Any: callers pass the six arguments, not numba's typing context
transpose_tile: Any = intrinsic(_transpose_tile)


@njit(cache=True, nogil=True)
def _tile_start(i, length):  # type: ignore[no-untyped-def]  # numba types the arguments
    # the last tile overlaps its neighbour instead of running past the edge
    return min(i * TILE, length - TILE)


@njit(cache=True, nogil=True)
def _fill(out, start, stop, value):  # type: ignore[no-untyped-def]  # numba types the arguments
    # loops over views indexed from 0 vectorize; numba's slice assignment (overlap checks)
    # and loops over ``out[start + k]`` (negative-index wraparound) run 6-25x slower
    view = out[start:stop]
    for k in range(view.shape[0]):
        view[k] = value


@njit(cache=True, nogil=True)
def _copy(out, dst, x, src, count):  # type: ignore[no-untyped-def]  # numba types the arguments
    to = out[dst : dst + count]
    frm = x[src : src + count]
    for k in range(count):
        to[k] = frm[k]


@njit(cache=True, nogil=True)
def _fill_border(out, img, i, ph, pw, h, w, hp, wp, ctot, fill):  # type: ignore[no-untyped-def]
    # image row i of the padded buffer starting at img: the pad rows above/below the image
    # (with its first row) and the pad pixels left/right of the row; returns the row's start
    rowlen = wp * ctot
    if i == 0:
        _fill(out, img, img + ph * rowlen, fill)
        _fill(out, img + (ph + h) * rowlen, img + hp * rowlen, fill)
    rbase = img + (ph + i) * rowlen
    _fill(out, rbase, rbase + pw * ctot, fill)
    _fill(out, rbase + (pw + w) * ctot, rbase + rowlen, fill)
    return rbase


@njit(cache=True, nogil=True)
def nchw_into_padded_nhwc(  # type: ignore[no-untyped-def]  # numba types the arguments
    x, n, c, h, w, groups, cg, cg4, ph, pw, wp, hp, fill, out
):  # fmt: skip
    """Fill flat ``out`` laid out ``[n, hp, wp, groups, cg4]`` from flat NCHW ``x``.

    Input channel ``g*cg + k`` lands at ``g*cg4 + k`` of pixel ``(ph + i, pw + j)``; the
    border pixels and the channel padding get ``fill`` (the zero point), so ``out`` may start
    uninitialized (saves a separate fill pass over the whole buffer).
    """
    ctot = groups * cg4
    hw = h * w
    rowlen = wp * ctot
    tiled = cg >= TILE and w >= TILE
    ntc = (cg + TILE - 1) // TILE
    ntw = (w + TILE - 1) // TILE
    for b in range(n):
        img = b * hp * rowlen
        for i in range(h):
            rbase = _fill_border(out, img, i, ph, pw, h, w, hp, wp, ctot, fill)
            drow = rbase + pw * ctot
            for g in range(groups):
                src0 = ((b * c + g * cg) * h + i) * w
                dst0 = drow + g * cg4
                for k in range(cg, cg4):  # channel padding: one strided view per channel
                    pad = out[dst0 + k : dst0 + k + (w - 1) * ctot + 1 : ctot]
                    for j in range(w):
                        pad[j] = fill
                if tiled:
                    for tc in range(ntc):
                        c0 = _tile_start(tc, cg)
                        for tw in range(ntw):
                            j0 = _tile_start(tw, w)
                            transpose_tile(
                                x, src0 + c0 * hw + j0, hw, out, dst0 + j0 * ctot + c0, ctot
                            )
                else:
                    # few channels (a 3-channel input layer) or narrow rows: per channel, a
                    # contiguous source row into a strided destination, through 0-based views
                    for k in range(cg):
                        src = x[src0 + k * hw : src0 + k * hw + w]
                        dst = out[dst0 + k : dst0 + k + (w - 1) * ctot + 1 : ctot]
                        for j in range(w):
                            dst[j] = src[j]


@njit(cache=True, nogil=True)
def nhwc_into_padded_nhwc(  # type: ignore[no-untyped-def]  # numba types the arguments
    x, n, h, w, groups, cg, cg4, ph, pw, wp, hp, fill, out
):  # fmt: skip
    """``nchw_into_padded_nhwc`` for channels-last input: flat ``x`` laid out ``[n, h, w, C]``."""
    ctot = groups * cg4
    c = groups * cg
    rowlen = wp * ctot
    for b in range(n):
        img = b * hp * rowlen
        for i in range(h):
            rbase = _fill_border(out, img, i, ph, pw, h, w, hp, wp, ctot, fill)
            src = (b * h + i) * w * c
            dst = rbase + pw * ctot
            if cg4 == cg:  # one contiguous run per input row
                _copy(out, dst, x, src, w * c)
                continue
            for j in range(w):
                for g in range(groups):
                    d = dst + j * ctot + g * cg4
                    _copy(out, d, x, src + j * c + g * cg, cg)
                    _fill(out, d + cg, d + cg4, fill)
