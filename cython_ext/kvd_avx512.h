/* AVX-512 backend (F/BW/VL + F16C conversions), bit-identical to kvd/codec/reference.py.
 *
 * Theory of operation
 * -------------------
 * float16 data stays in 16-bit lanes (32 values per zmm) for everything that needs no arithmetic: the absmax
 * of a group is an unsigned max over (bits & 0x7fff) (for non-negative float16 the integer order is the
 * float order), which is also the NaN/Inf check ((bits & 0x7fff) >= 0x7c00); the q4 min/max run on a signed
 * integer key (bits ^ 0x7fff for x < 0, i.e. sign-magnitude to two's complement, so -0 sorts just below +0:
 * the rule of kvd_scalar.h), on 16-bit float16 bits or on 32-bit float32 bits. Arithmetic is float32 (16 lanes), one IEEE operation per reference step,
 * with conversions by vcvtph2ps / vcvtps2ph (explicit round-to-nearest-even).
 *
 * Fast paths (the shapes kvd pages use) handle 16 groups at once: pass 1 loads each group and reduces it to a
 * vector, a transposed tree reduces the 16 vectors to one vector of 16 group results (natural order), the
 * scales of all 16 groups are computed in one vector, pass 2 reloads the data (from L1) and quantizes. Column
 * kernels need no horizontal reduction at all: a block of columns is reduced down the tokens. Everything else
 * (odd group sizes, partial groups) takes the generic paths: one group at a time with masked tails and the
 * scalar per-group helpers of kvd_scalar.h, which are the same arithmetic.
 *
 * The Hadamard butterflies inside one register use FMA with a multiplier of +-1: x * (+-1) is exact, so
 * fma(x, +-1, p) is the single rounding of p +- x, the very addition or subtraction the reference performs.
 */
#ifndef KVD_AVX512_H
#define KVD_AVX512_H

#include "kvd_avx512_q4.h"
#include "kvd_avx512_q8.h"

static const kvd_backend kvd_backend_avx512 = {
    "avx512",
    kvd512_f16_copy_rows,
    kvd512_q8_encode_rows,
    kvd512_q8_decode_rows,
    kvd512_q8_encode_cols,
    kvd512_q8_decode_cols,
    kvd512_fp8_encode_rows,
    kvd512_fp8_decode_rows,
    kvd512_q4_encode_rows,
    kvd512_q4_decode_rows,
    kvd512_q4_encode_cols,
    kvd512_q4_decode_cols,
    kvd512_q4_encode_rows_pf,
};


#endif
