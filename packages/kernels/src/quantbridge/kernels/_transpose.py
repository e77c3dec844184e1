"""uint8 conv input (NCHW or channels-last) → the zero-point-padded channels-last buffer.

numpy's transposing copy moves ~3 bytes per ns here; the conv kernels then wait on it (60 µs
of a 620 µs 64-channel 56x56 conv). The copy below moves 16x16 byte tiles through vector
registers: 16 row loads, four rounds of byte interleaves (the perfect shuffle, applied
log2(16) times, transposes a 16x16 matrix), 16 row stores. The IR uses only generic vector
loads, ``shufflevector`` and stores, so it compiles for any CPU LLVM targets (SSE2
``punpck*`` on x86-64) and serves every kernel target.

Edges narrower than a tile are handled by an overlapping last tile (rewriting bytes with the
same values); dimensions under 16 fall back to scalar loops.

Inputs of 1-3 channels (a network's stem) have no 16-channel tiles; ``spread_copy`` moves 16
pixels at a time instead (``spread_pixels``: one load per channel plane, or one of 16 whole
pixels, and one shuffle into 4-byte or unpadded pixels), 10-60x faster than the per-channel
loops.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from quantbridge.kernels._ir import load_vec, store_vec, vec_broadcast

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

# (source layout, channels, channels per output pixel) of ``spread_pixels``: an RGB-like input
# of 1-3 channels into pixels of 4 bytes (the channel-padded layout) or of its own width (the
# stem's row-packed layout)
SPREAD_KINDS = [
    (nchw, cg, cg4) for nchw in (True, False) for cg in (1, 2, 3) for cg4 in sorted({cg, 4})
]
SPREAD_IDS = {kind: i for i, kind in enumerate(SPREAD_KINDS)}


def _spread_codegen(nchw: bool, cg: int, cg4: int) -> Any:
    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> ir.Value:
        x, xoff, plane, out, ooff, fill = args
        x_ptr = context.make_array(signature.args[0])(context, builder, x).data
        o_ptr = context.make_array(signature.args[3])(context, builder, out).data

        def load(at: ir.Value, lanes: int) -> ir.Value:
            return load_vec(builder, builder.gep(x_ptr, [at]), ir.VectorType(_I8, lanes))

        fill8 = builder.trunc(fill, _I8)
        if nchw:
            # one 16-pixel run per channel plane and a run of fill bytes per padding channel,
            # interleaved pairwise (a byte transpose, as in transpose_tile): LLVM lowered one
            # wide shuffle of three runs and a fill vector 10x slower
            fills = vec_broadcast(builder, fill8, TILE)
            runs = [load(builder.add(xoff, builder.mul(plane, ir.Constant(plane.type, k))), TILE)
                    for k in range(cg)] + [fills] * (cg4 - cg)  # fmt: skip
            while len(runs) > 1:  # concatenate pairwise: (p, k) at k * 16 + p
                a, b = runs[0], runs[1]
                la, lb = a.type.count, b.type.count
                if la != lb:  # widen the shorter to concatenate (its extra lanes unused)
                    b = builder.shuffle_vector(
                        b, ir.Constant(b.type, ir.Undefined),
                        ir.Constant(ir.VectorType(_I32, la), [*range(lb), *[0] * (la - lb)]),
                    )  # fmt: skip
                runs = [
                    builder.shuffle_vector(
                        a, b, ir.Constant(ir.VectorType(_I32, la + lb), list(range(la + lb)))
                    ),
                    *runs[2:],
                ]
            mask = [k * TILE + p for p in range(TILE) for k in range(cg4)]
            src, other = runs[0], runs[0]
        else:  # 16 whole pixels, (p, k) at p * cg + k; fill from lane 0 of a second vector
            src = load(xoff, TILE * cg)
            other = builder.insert_element(
                ir.Constant(src.type, ir.Undefined), fill8, ir.Constant(_I32, 0)
            )
            lanes = src.type.count
            mask = [p * cg + k if k < cg else lanes for p in range(TILE) for k in range(cg4)]
        row = builder.shuffle_vector(src, other, ir.Constant(ir.VectorType(_I32, len(mask)), mask))
        store_vec(builder, row, builder.gep(o_ptr, [ooff]))
        return context.get_dummy_value()

    return codegen


_SPREAD_CODEGENS = [_spread_codegen(*kind) for kind in SPREAD_KINDS]


def _spread_pixels(
    typingctx: Any, kind: Any, x: Any, xoff: Any, plane: Any, out: Any, ooff: Any, fill: Any
) -> Any:
    """16 pixels of ``cg`` channels into ``out[ooff : ooff + 16 * cg4]``, ``cg4`` bytes a pixel
    (channels ``cg..cg4-1`` get ``fill``), for ``kind = SPREAD_IDS[(nchw, cg, cg4)]``.

    NCHW: channel ``k`` of pixel ``p`` is ``x[xoff + k * plane + p]``; channels-last:
    ``x[xoff + p * cg + k]`` (``plane`` unused). The caller keeps every byte in bounds.
    """
    if not isinstance(kind, types.IntegerLiteral):
        return None  # numba retries with the literal type when the value is a constant
    sig = types.void(kind, x, xoff, plane, out, ooff, fill)
    inner = _SPREAD_CODEGENS[kind.literal_value]

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> ir.Value:
        inner_sig = types.void(*signature.args[1:])
        return inner(context, builder, inner_sig, args[1:])

    return sig, codegen


# typed Any: callers pass the seven arguments, not numba's typing context
spread_pixels: Any = intrinsic(_spread_pixels)


def _make_spread_copy(nchw: bool, cg: int, cg4: int) -> Any:
    """``nchw_into_padded_nhwc`` (or ``nhwc_``) for one group of ``cg`` channels in ``cg4``-byte
    pixels and rows of at least 16 pixels, 16 pixels a ``spread_pixels`` call (the kind a
    closure constant, so a literal); the last tile of a row moved back to end at its end (it
    rewrites bytes with the same values)."""
    kid = SPREAD_IDS[(nchw, cg, cg4)]
    step = 1 if nchw else cg  # source elements from one pixel to the next

    def copy(x, n, h, w, fill, out, ph, pw, wp, hp):  # type: ignore[no-untyped-def]
        rowlen = wp * cg4
        hw = h * w
        for b in range(n):
            img = b * hp * rowlen
            for i in range(h):
                rbase = _fill_border(out, img, i, ph, pw, h, w, hp, wp, cg4, fill)
                src = b * cg * hw + i * w if nchw else (b * h + i) * w * cg
                dst = rbase + pw * cg4
                for t in range((w + TILE - 1) // TILE):
                    p = _tile_start(t, w)
                    spread_pixels(kid, x, src + p * step, hw, out, dst + p * cg4, fill)

    name = f"spread_{'nchw' if nchw else 'nhwc'}_{cg}_{cg4}"
    copy.__name__ = copy.__qualname__ = name
    return njit(cache=True, nogil=True)(copy)


_SPREAD_COPIES = {kind: _make_spread_copy(*kind) for kind in SPREAD_KINDS}


def spread_copy(nchw: bool, groups: int, cg: int, cg4: int, w: int) -> Any:
    """The ``spread_pixels`` copy for this layout, or None (``nchw_into_padded_nhwc`` /
    ``nhwc_into_padded_nhwc`` serve it): called ``copy(x, n, h, w, fill, out, ph, pw, wp, hp)``
    on flat arrays."""
    if groups != 1 or w < TILE:
        return None
    return _SPREAD_COPIES.get((nchw, cg, cg4))


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
