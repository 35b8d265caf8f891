"""Triton kernels of l47.tail.fused (imported only where Triton is installed; the equations are in fused's
docstring). One epilogue for both producers: tile max, exp-sum, Σ e·z, top-k (ties by the lower id) per row."""

import triton
import triton.language as tl

cdiv = triton.cdiv


KTOP_UNROLL = tl.constexpr(8)  # top-k rounds unrolled up to this k (the scoring's k = 5); a loop above it


@triton.jit
def _next_top(zz, it, cols, j, o, mrow, TV, TI, pid_n, lo, KTOP: tl.constexpr, BN: tl.constexpr):
    """Top-k round j: the previous pick masked out, the next max with its lowest id stored.
    Many parameters because a Triton device function takes every pointer, index and compile-time constant it reads
    as an argument (no structs)."""
    zz = tl.where(cols[None, :] == it[:, None], -float("inf"), zz)
    v, it = tl.max(zz, 1, return_indices=True, return_indices_tie_break_left=True)
    tl.store(TV + o * KTOP + j, v, mask=mrow)
    tl.store(TI + o * KTOP + j, (it + pid_n * BN + lo).to(tl.int32), mask=mrow)
    return zz, it


@triton.jit
def _epilogue(z, rm, rn, pid_n, mrow, mcol, M, S, SZ, TV, TI, NT, lo, KTOP: tl.constexpr, BN: tl.constexpr):
    """One [BM, BN] tile of logits z -> its partials per row (max, exp-sum, Σ e·z, top-k) stored at the tile's
    slot. Many parameters because a Triton device function takes every pointer, index and compile-time constant
    it reads as an argument (no structs)."""
    z = tl.where(mcol[None, :], z, -float("inf"))
    mt, it = tl.max(z, 1, return_indices=True, return_indices_tie_break_left=True)  # tile max, its lowest id
    e = tl.exp(z - mt[:, None])
    st = tl.sum(e, 1)
    szt = tl.sum(tl.where(mcol[None, :], e * z, 0.0), 1)
    o = rm * NT + pid_n
    tl.store(M + o, mt, mask=mrow)
    tl.store(S + o, st, mask=mrow)
    tl.store(SZ + o, szt, mask=mrow)
    if KTOP > 0:
        tl.store(TV + o * KTOP, mt, mask=mrow)
        tl.store(TI + o * KTOP, (it + pid_n * BN + lo).to(tl.int32), mask=mrow)
        zz = z
        cols = tl.arange(0, BN)
        if KTOP <= KTOP_UNROLL:
            for j in tl.static_range(1, KTOP):
                zz, it = _next_top(zz, it, cols, j, o, mrow, TV, TI, pid_n, lo, KTOP, BN)
        else:
            # rolled: unrolled, KTOP = 64 (the sets' sampler guard) took 24 s (single) and 87 s (paired) to
            # compile on one H200
            for j in tl.range(1, KTOP):
                zz, it = _next_top(zz, it, cols, j, o, mrow, TV, TI, pid_n, lo, KTOP, BN)
    return e, mt


@triton.jit
def reduce_kernel(Z, szr, R, P, C, NT, t0, lo, M, S, SZ, A, TV, TI,
                  BM: tl.constexpr, BN: tl.constexpr, KTOP: tl.constexpr, PAIRED: tl.constexpr):
    """Partials of logits already computed (Z [R, C], row stride szr), one [BM, BN] tile a program; PAIRED:
    also A for the base rows against their edited rows P.. . Many parameters because a Triton kernel's
    signature is its launch: every pointer, size and compile-time constant is one argument (no structs)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mrow = rm < R
    mcol = rn < C
    z = tl.load(Z + rm[:, None] * szr + rn[None, :], mask=mrow[:, None] & mcol[None, :], other=0.0)
    e, mt = _epilogue(z, rm, rn, t0 + pid_n, mrow, mcol, M, S, SZ, TV, TI, NT, lo - t0 * BN, KTOP, BN)
    if PAIRED:
        if pid_m * BM < P:
            mp = mrow & (rm < P)
            zn = tl.load(Z + (rm + P)[:, None] * szr + rn[None, :], mask=mp[:, None] & mcol[None, :],
                         other=0.0)
            at = tl.sum(tl.where(mcol[None, :], e * (z - zn), 0.0), 1)
            tl.store(A + rm * NT + t0 + pid_n, at, mask=mp)

@triton.jit
def split_kernel(XH, XL, XI, HH, HL, HI, MROWS, P, V, N, NT, M, S, SZ, A, TV, TI, ZO,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                 KTOP: tl.constexpr, PAIRED: tl.constexpr, WRITE_Z: tl.constexpr, PROMOTE: tl.constexpr):
    """The head GEMM in split fp16 (hi/lo parts of both operands, per-row power-of-two scales) with the
    partials in its epilogue; WRITE_Z also stores the logits. Many parameters because a Triton kernel's
    signature is its launch: every pointer, size and compile-time constant is one argument (no structs)."""
    # program -> (m block, vocabulary tile), grouped so a group's rows stay in L2 while it sweeps the head
    pid = tl.program_id(0)
    npm = tl.cdiv(MROWS, BM)
    in_group = GROUP * NT
    first = (pid // in_group) * GROUP
    gsz = tl.minimum(npm - first, GROUP)
    pid_m = first + (pid % in_group) % gsz
    pid_n = (pid % in_group) // gsz
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mrow = rm < MROWS
    mcol = rn < V
    xo = rm[:, None] * N + rk[None, :]  # [BM, BK]
    ho = rn[None, :] * N + rk[:, None]  # [BK, BN] (head rows as columns)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if PAIRED:
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, N, BK):
        bh = tl.load(HH + ho + k0, mask=mcol[None, :], other=0.0)
        bl = tl.load(HL + ho + k0, mask=mcol[None, :], other=0.0)
        ah = tl.load(XH + xo + k0, mask=mrow[:, None], other=0.0)
        al = tl.load(XL + xo + k0, mask=mrow[:, None], other=0.0)
        if PROMOTE:  # the block's BK-term partial on the tensor cores, added to acc by the CUDA cores (round to
            # nearest): the tensor cores' truncating accumulation then spans BK terms, not all of n
            acc += tl.dot(al, bh, tl.dot(ah, bl, tl.dot(ah, bh)))
        else:
            acc = tl.dot(al, bh, tl.dot(ah, bl, tl.dot(ah, bh, acc)))
        if PAIRED:
            ah2 = tl.load(XH + xo + P * N + k0, mask=mrow[:, None], other=0.0)
            al2 = tl.load(XL + xo + P * N + k0, mask=mrow[:, None], other=0.0)
            if PROMOTE:
                acc2 += tl.dot(al2, bh, tl.dot(ah2, bl, tl.dot(ah2, bh)))
            else:
                acc2 = tl.dot(al2, bh, tl.dot(ah2, bl, tl.dot(ah2, bh, acc2)))
    hinv = tl.load(HI + rn, mask=mcol, other=1.0)
    xinv = tl.load(XI + rm, mask=mrow, other=1.0)
    z = acc * xinv[:, None] * hinv[None, :]
    if WRITE_Z:
        tl.store(ZO + rm[:, None] * V + rn[None, :], z, mask=mrow[:, None] & mcol[None, :])
    e, mt = _epilogue(z, rm, rn, pid_n, mrow, mcol, M, S, SZ, TV, TI, NT, 0, KTOP, BN)
    if PAIRED:
        xinv2 = tl.load(XI + rm + P, mask=mrow, other=1.0)
        z2 = acc2 * xinv2[:, None] * hinv[None, :]
        at = tl.sum(tl.where(mcol[None, :], e * (z - z2), 0.0), 1)
        tl.store(A + rm * NT + pid_n, at, mask=mrow)
        _epilogue(z2, rm + P, rn, pid_n, mrow, mcol, M, S, SZ, TV, TI, NT, 0, KTOP, BN)


@triton.jit
def split_kernel_stacked(XH, XL, XI, HH, HL, HI, MROWS, P, V, N, NT, M, S, SZ, A, TV, TI, ZO,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                         KTOP: tl.constexpr, PAIRED: tl.constexpr, WRITE_Z: tl.constexpr, PROMOTE: tl.constexpr):
    """split_kernel with one accumulator: a program's BM rows are rows i..i+BM/2-1 stacked on rows P+i..P+i+BM/2-1
    (one [BM, BK] operand, the same products per logit as split_kernel). PAIRED: those are a pair's base and
    edited rows (P pairs, MROWS = 2P), split back into the two halves for the pair term; else any MROWS rows with
    P = ceil(MROWS / 2). One [BM, BN] accumulator (split_kernel's paired tile: two) leaves the registers and
    shared memory for deeper pipelines or BK 64 at 3 stages. WRITE_Z stores the logits of every row into ZO
    [MROWS, V]. Many parameters because a Triton kernel's signature is its launch: every pointer, size and
    compile-time constant is one argument (no structs)."""
    BMH: tl.constexpr = BM // 2
    pid = tl.program_id(0)
    npm = tl.cdiv(P, BMH)
    in_group = GROUP * NT
    first = (pid // in_group) * GROUP
    gsz = tl.minimum(npm - first, GROUP)
    pid_m = first + (pid % in_group) % gsz
    pid_n = (pid % in_group) // gsz
    j = tl.arange(0, BM)
    pr = pid_m * BMH + j % BMH  # the pair of each stacked row
    rm = tl.where(j < BMH, pr, pr + P)  # its row of XH / XL (base rows 0..P-1, edited rows P..2P-1)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mrow = (pr < P) & (rm < MROWS)
    mcol = rn < V
    xo = rm[:, None] * N + rk[None, :]  # [BM, BK]
    ho = rn[None, :] * N + rk[:, None]  # [BK, BN] (head rows as columns)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, N, BK):
        bh = tl.load(HH + ho + k0, mask=mcol[None, :], other=0.0)
        bl = tl.load(HL + ho + k0, mask=mcol[None, :], other=0.0)
        ah = tl.load(XH + xo + k0, mask=mrow[:, None], other=0.0)
        al = tl.load(XL + xo + k0, mask=mrow[:, None], other=0.0)
        if PROMOTE:  # as split_kernel: the block's BK-term partial added to acc on the CUDA cores
            acc += tl.dot(al, bh, tl.dot(ah, bl, tl.dot(ah, bh)))
        else:
            acc = tl.dot(al, bh, tl.dot(ah, bl, tl.dot(ah, bh, acc)))
    hinv = tl.load(HI + rn, mask=mcol, other=1.0)
    xinv = tl.load(XI + rm, mask=mrow, other=1.0)
    z = acc * xinv[:, None] * hinv[None, :]
    if WRITE_Z:
        tl.store(ZO + rm[:, None] * V + rn[None, :], z, mask=mrow[:, None] & mcol[None, :])
    e, mt = _epilogue(z, rm, rn, pid_n, mrow, mcol, M, S, SZ, TV, TI, NT, 0, KTOP, BN)
    if PAIRED:  # the pair term: rows j and BMH + j are base and edited of one pair
        zb, zn = tl.split(tl.permute(tl.reshape(z, (2, BMH, BN)), (1, 2, 0)))  # [BMH, BN] each
        eb, _ = tl.split(tl.permute(tl.reshape(e, (2, BMH, BN)), (1, 2, 0)))
        at = tl.sum(tl.where(mcol[None, :], eb * (zb - zn), 0.0), 1)  # [BMH]
        pb = pid_m * BMH + tl.arange(0, BMH)
        tl.store(A + pb * NT + pid_n, at, mask=pb < P)
