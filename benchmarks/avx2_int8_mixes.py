"""The exact int8 products' instruction mixes on AVX2 without VNNI, in register-only loops on one core: how fast
this core runs latentserve's (`kernels/int8_nibbles.h`: each activation byte as two nibbles, vpmaddubsw of each
against the signed weights, int16 sums widened once per 8 steps) against the sign trick ik_llama.cpp and llama.cpp
use (vpshufd the activations, vpsignb them by the weights, vpmaddubsw with |w|, vpmaddwd, vpaddd), against words
(int16 activations and weights widened to int16 once for many rows, vpmaddwd and vpaddd: tried as a kernel and not
adopted, benchmarks/RESULTS.md "Tried and not adopted"), and the vector ports' rate for vpaddw and vpmaddubsw
alone. No memory is read: this is the ceiling of each mix, the floor under
any kernel built on it (benchmarks/RESULTS.md "As an AVX2-only CPU").

The clock is measured in the same rounds (a chain of dependent imuls, 3 cycles each), so the cycle counts hold
while the frequency moves; the rounds alternate the loops. Needs a C compiler and an AVX2 CPU.

Run: `.venv/bin/python benchmarks/avx2_int8_mixes.py [--rounds 5]`.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Each loop: one iteration's vector operations, on registers only; `ITER` iterations a run. The empty asm keeps the
# compiler from folding or reassociating the chains. ours: 2 rows x 2 halves of a unit (int8_nibbles.h's
# lanes_unit: 4 vpmaddubsw + 4 vpaddw = 64 products) and an eighth of the widening (vpmaddwd x2 + vpaddd x2 per row
# and half every 8 units) -> 128 products. sign: 4 x (vpshufd, vpsignb, vpmaddubsw, vpmaddwd, vpaddd) = 128.
SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define ITER 50000000L
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
#define KEEP(...) __asm__ volatile("" : __VA_ARGS__)
static double clock_ghz(void) {
    long x = 3; double t = now();
    for (long i = 0; i < ITER; i++)
        __asm__ volatile("imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0" : "+r"(x));
    return 12.0 * ITER / (now() - t) / 1e9;
}
static double ours(void) {
    __m256i xh = _mm256_set1_epi8(3), xl = _mm256_set1_epi8(5), w0 = _mm256_set1_epi8(7), w1 = _mm256_set1_epi8(9);
    __m256i h0 = _mm256_setzero_si256(), h1 = h0, l0 = h0, l1 = h0, a0 = h0, a1 = h0, m16 = _mm256_set1_epi16(16),
            m1 = _mm256_set1_epi16(1);
    double t = now();
    for (long i = 0; i < ITER; i++) {
        for (int row = 0; row < 2; row++) {
            h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(xh, w0));
            l0 = _mm256_add_epi16(l0, _mm256_maddubs_epi16(xl, w0));
            h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(xh, w1));
            l1 = _mm256_add_epi16(l1, _mm256_maddubs_epi16(xl, w1));
            KEEP("+x"(h0), "+x"(h1), "+x"(l0), "+x"(l1), "+x"(xh), "+x"(xl), "+x"(w0), "+x"(w1));
        }
        if ((i & 3) == 0) { /* the widening: 4 sums of a row pair every 8 units, here a quarter every 4 iterations */
            a0 = _mm256_add_epi32(a0, _mm256_add_epi32(_mm256_madd_epi16(h0, m16), _mm256_madd_epi16(l0, m1)));
            a1 = _mm256_add_epi32(a1, _mm256_add_epi32(_mm256_madd_epi16(h1, m16), _mm256_madd_epi16(l1, m1)));
            KEEP("+x"(a0), "+x"(a1), "+x"(m16), "+x"(m1));
        }
    }
    double dt = now() - t;
    int r[8];
    _mm256_storeu_si256((__m256i *)r, _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi16(h0, l1)));
    return dt + r[0] * 1e-300;
}
static double sign(void) {
    __m256i y = _mm256_set1_epi8(3), q0 = _mm256_set1_epi8(5), q1 = _mm256_set1_epi8(7), s0 = _mm256_set1_epi8(9),
            s1 = _mm256_set1_epi8(11), m1 = _mm256_set1_epi16(1);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0;
    double t = now();
#define STEP(c, perm, q, s)                                                                  \
    c = _mm256_add_epi32(c, _mm256_madd_epi16(m1, _mm256_maddubs_epi16(                         \
                                                      s, _mm256_sign_epi8(_mm256_shuffle_epi32(y, perm), q))))
    for (long i = 0; i < ITER; i++) {
        STEP(c0, 0x00, q0, s0); STEP(c1, 0x55, q1, s1); STEP(c2, 0xaa, q0, s0); STEP(c3, 0xff, q1, s1);
        KEEP("+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(y), "+x"(q0), "+x"(q1), "+x"(s0), "+x"(s1));
    }
    double dt = now() - t;
    int r[8];
    _mm256_storeu_si256((__m256i *)r, _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)));
    return dt + r[0] * 1e-300;
}
/* words: the activations as int16 and the weights widened once to int16 for many rows, vpmaddwd + vpaddd: 3 rows
 * x 4 registers of 8 pairs = 192 products for 24 operations. */
static double words(void) {
    __m256i w0 = _mm256_set1_epi16(7), w1 = _mm256_set1_epi16(9), w2 = _mm256_set1_epi16(5), w3 = _mm256_set1_epi16(3);
    __m256i x = _mm256_set1_epi16(3), c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0,
            c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
    double t = now();
#define MADD(c, w) c = _mm256_add_epi32(c, _mm256_madd_epi16(w, x))
    for (long i = 0; i < ITER; i++) {
        MADD(c0, w0); MADD(c1, w1); MADD(c2, w2); MADD(c3, w3); MADD(c4, w0); MADD(c5, w1);
        MADD(c6, w2); MADD(c7, w3); MADD(c8, w0); MADD(c9, w1); MADD(c10, w2); MADD(c11, w3);
        KEEP("+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4), "+x"(c5), "+x"(c6), "+x"(c7), "+x"(c8), "+x"(c9),
             "+x"(c10), "+x"(c11), "+x"(x));
    }
    double dt = now() - t;
    int r[8];
    _mm256_storeu_si256((__m256i *)r, _mm256_add_epi32(c0, c11));
    return dt + r[0] * 1e-300;
}
#define TWELVE(op) op(c0); op(c1); op(c2); op(c3); op(c4); op(c5); op(c6); op(c7); op(c8); op(c9); op(c10); op(c11)
#define ALL "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4), "+x"(c5), "+x"(c6), "+x"(c7), "+x"(c8), "+x"(c9), \
            "+x"(c10), "+x"(c11)
#define ADDW(c) c = _mm256_add_epi16(c, w)
#define MADDUBS(c) c = _mm256_maddubs_epi16(c, w)
static double twelve(int multiply) {
    __m256i w = _mm256_set1_epi8(1), c0 = _mm256_set1_epi8(2), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0,
            c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
    double t = now();
    if (multiply)
        for (long i = 0; i < ITER; i++) { TWELVE(MADDUBS); KEEP(ALL); }
    else
        for (long i = 0; i < ITER; i++) { TWELVE(ADDW); KEEP(ALL); }
    double dt = now() - t;
    int r[8]; _mm256_storeu_si256((__m256i *)r, _mm256_add_epi16(c0, c11));
    return dt + r[0] * 1e-300;
}
int main(void) {
    double ghz = clock_ghz(), o = ours(), s = sign(), a = twelve(0), m = twelve(1), w = words();
    printf("%.4f %.6f %.6f %.6f %.6f %.6f\n", ghz, o, s, a, m, w);
    return 0;
}
"""


def run_once(binary: Path) -> dict[str, float]:
    """One round: the clock (GHz) and each loop's cycles per iteration at it."""
    ghz, ours, sign, adds, mults, words = map(float, subprocess.run([str(binary)], capture_output=True, text=True,
                                                              check=True).stdout.split())
    per_iter = lambda seconds: seconds * ghz * 1e9 / 50_000_000  # noqa: E731 (ITER)
    return {"GHz": ghz, "ours": per_iter(ours), "sign": per_iter(sign), "vpaddw": per_iter(adds),
            "vpmaddubsw": per_iter(mults), "words": per_iter(words)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cc", default="cc")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "mixes.c", Path(tmp) / "mixes"
        source.write_text(SOURCE)
        built = subprocess.run([args.cc, "-O2", "-mavx2", "-mfma", str(source), "-o", str(binary)],
                               capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"{args.cc} could not build the loops:\n{built.stderr}")
        rounds = [run_once(binary) for _ in range(args.rounds)]
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"clock {med['GHz']:.2f} GHz (median of {args.rounds} rounds; {min(r['GHz'] for r in rounds):.2f}-"
          f"{max(r['GHz'] for r in rounds):.2f})")
    print("| loop | cycles an iteration | products a cycle | operations a cycle |\n|---|---|---|---|")
    print(f"| ours: nibbles (8 vpmaddubsw, 8 vpaddw, 2 of the widening) | {med['ours']:.2f} | "
          f"{128 / med['ours']:.1f} | {18 / med['ours']:.2f} |")
    print(f"| sign trick (4 x vpshufd, vpsignb, vpmaddubsw, vpmaddwd, vpaddd) | {med['sign']:.2f} | "
          f"{128 / med['sign']:.1f} | {20 / med['sign']:.2f} |")
    print(f"| words (12 vpmaddwd, 12 vpaddd: 192 products) | {med['words']:.2f} | {192 / med['words']:.1f} | "
          f"{24 / med['words']:.2f} |")
    print(f"| 12 vpaddw | {med['vpaddw']:.2f} | | {12 / med['vpaddw']:.2f} |")
    print(f"| 12 vpmaddubsw | {med['vpmaddubsw']:.2f} | | {12 / med['vpmaddubsw']:.2f} |")
    print(f"ours / sign, products a cycle: {med['sign'] / med['ours']:.2f}x")


if __name__ == "__main__":
    main()
