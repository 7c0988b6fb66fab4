// Shared W12 device code: record layout 1 (the mma.sync fragment order) and its split form (layouts
// 3 and 4, what the GEMM kernels read since session 14), the register decodes with a fixed exponent
// offset, and the small PTX wrappers the GEMM kernels use.
//
// Portable sm_80+ (mma.sync, cp.async); usable from the sm_90a Hopper kernels too. Torch-free.
//
// ---------------------------------------------------------------------------------------------
// Layout 1 ("mma_sync_m16n8k16"), defined once here and in w12/layouts.py (the CPU side builds
// the same permutation from the same formulas; tests compare the two through an emulation).
//
// A record is 128 rows x 64 columns. Warp w (0..3) of a 128-thread CTA owns rows 32w..32w+31;
// lane = 4g + t (g = lane>>2, t = lane&3). The thread owns 64 elements, read as 4 hi vectors of
// 16 bytes (q = 0..3) and the matching 4 lo vectors of 8 bytes:
//     hi slot  i = 2048w + 512q + 16*lane + e            (e = 0..15)
//     lo byte    = i / 2 = 1024w + 256q + 8*lane + e/2   (even e in the low nibble)
// so every warp-wide 16-byte hi load and 8-byte lo load is one contiguous 512/256-byte run:
// coalesced from global memory and free of shared-memory bank conflicts.
//
// Element e of vector q decodes into A-fragment register R = 8q + 2*(e/4) + (e&1), half
// h = (e>>1)&1 (pairs (0,2) and (1,3) of each hi word share a register: see decode_pair). Register
// R = 16mt + 4ks + r is operand a_r of the m16n8k16 MMA for m-tile mt and k-step ks, and holds
//     row = 32w + 16mt + g + 8*(r&1),   col = 16t + 4ks + 2*(r>>1) + h.
// The columns are a permutation of the MMA's k index (the MMA's k order is free as long as A and
// B agree): with it, thread t needs activations x[token][16t .. 16t+15] for all four k-steps,
// i.e. two 16-byte loads of the activation tile per 8 tokens.
// ---------------------------------------------------------------------------------------------
#pragma once

#include <stdint.h>

namespace w12 {

// Fixed exponent offset E0: the kernel decodes code c|m as BF16 with biased exponent c + E0 and
// multiplies the FP32 accumulator by 2^(b - E0) in the epilogue (format §2 note). E0 = 112 makes
// the exponent field an OR (E0 has its low four bits clear) and puts decoded weights in
// [2^-15, 2): products with BF16 activations stay far from FP32 overflow and underflow for any
// activation magnitude a model produces, and 2^(b - E0) for b in [1, 239] is a normal float.
constexpr int kDecodeE0 = 112;

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Two BF16 weights (with the fixed offset E0) from one hi word and the nibble word of the pair.
//   hw:   hi word (4 hi bytes, elements 0..3 of a group of four slots)
//   nib:  the lo word (E: even nibbles) or the lo word >> 4 (O: odd nibbles); the wanted nibble
//         is the low nibble of each byte, the high nibble is junk (never selected below)
//   P:    0 -> elements (0,2) of the hi word, 1 -> elements (1,3)
//   HALF: 0 -> the hi word is the first of the lo word's two, 1 -> the second
// Result bits per half: s<<15 | (c|E0)<<7 | m, in four instructions:
// - PRMT with the sign-replicate selector bit makes each half the 16-bit sign extension of its hi
//   byte h; << 4 then puts h at bits 4..11 and copies of s at bits 12..15 (bit 15 is the BF16
//   sign; the low half's spill lands in the high half's bits 0..3);
// - PRMT of the nibble word against 0x38383838 gives each half 0x38 in its high byte (E0's
//   exponent bits 11..13, bit 14 clear) and the nibble in its low byte (junk high nibble);
// - one LOP3 selects bits 15 and 4..10 from the first and everything else (E0, nibble) from the
//   second: (t & 0x87F087F0) | (lo & ~0x87F087F0). The junk of both inputs is never selected.
// Session 8: one instruction fewer per pair than the mask-and-OR form (32 per warp and record).
//   k38:  0x38383838 (E0's low exponent bits in every byte); see decode16 for why it is an operand
template <int P, int HALF>
__device__ __forceinline__ uint32_t decode_pair(uint32_t hw, uint32_t nib, uint32_t k38) {
  constexpr uint32_t kHiSel = P == 0 ? 0xA280u : 0xB391u;    // [h_P, sext(h_P), h_P+2, sext(h_P+2)]
  constexpr uint32_t kLoSel = HALF == 0 ? 0x4140u : 0x4342u;  // [n, 0x38, n', 0x38]
  const uint32_t t = prmt(hw, 0u, kHiSel) << 4;
  const uint32_t lo = prmt(nib, k38, kLoSel);
  uint32_t d;
  // LUT 0xE2 = (a & b) | (c & ~b) with a = t, b = the bit-select mask, c = lo.
  asm("lop3.b32 %0, %1, %2, %3, 0xE2;" : "=r"(d) : "r"(t), "n"(0x87F087F0), "r"(lo));
  return d;
}

// Decodes one 16-element hi vector (4 words) and its 8 lo bytes (2 words) into 8 registers of
// BF16 pairs, A[0..7] in fragment order (see the layout comment above).
// k38 must be 0x38383838. A PRMT takes one immediate: given both the selector and 0x38383838 as
// literals, ptxas makes 0x38383838 the immediate and re-materialises the selector into a
// register before every lo PRMT (16 extra moves per 64 weights). A caller that passes a value
// ptxas cannot see as constant (see opaque_k38) gets the selector as the immediate instead.
__device__ __forceinline__ void decode16(const uint4& hi, const uint2& lo, uint32_t* a, uint32_t k38 = 0x38383838u) {
  const uint32_t e0 = lo.x, o0 = lo.x >> 4;
  const uint32_t e1 = lo.y, o1 = lo.y >> 4;
  a[0] = decode_pair<0, 0>(hi.x, e0, k38);
  a[1] = decode_pair<1, 0>(hi.x, o0, k38);
  a[2] = decode_pair<0, 1>(hi.y, e0, k38);
  a[3] = decode_pair<1, 1>(hi.y, o0, k38);
  a[4] = decode_pair<0, 0>(hi.z, e1, k38);
  a[5] = decode_pair<1, 0>(hi.z, o1, k38);
  a[6] = decode_pair<0, 1>(hi.w, e1, k38);
  a[7] = decode_pair<1, 1>(hi.w, o1, k38);
}

// ---------------------------------------------------------------------------------------------
// Split-plane records (layouts 3 and 4, w12/layouts.py): the same 16 bytes + 8 bytes a thread
// loads per vector, but stored so that the decode needs 7 instructions per 8 weights instead of 17.
// A BF16 weight with the fixed offset E0 is two bytes: its low byte is c0|m (8 stored bits, kept
// whole: the "L" byte) and its high byte s|0|111|c3c2c1 (0x38 | 4 stored bits). The 16-byte vector
// holds the L bytes in register order (byte p = register p/2 of the vector, half p%2); each 4-byte
// word of the 8-byte vector (the "N" word of 8 weights p = 8j..8j+7) holds the 4 remaining bits of
// its 8 weights, arranged so that two masks and one rotate make all 8 high bytes:
//     N byte i = sA_i << 7 | cB_{(i+1)&3} << 4 | sB_i << 3 | cA_i
// with A_i = weight 8j + i, B_i = weight 8j + 4 + i, s its sign and c its c3c2c1. Then
//     HA = (N & 0x87878787) | 0x38383838                 (high bytes of A_0..A_3)
//     HB = (rotl(N, 4) & 0x87878787) | 0x38383838       (high bytes of B_0..B_3)
// and each register is one PRMT of an L word and HA or HB. The decoded values are those of
// decode16, so the GEMM bits do not change. Session 14 (docs/perf-notes.md): the decode's integer
// work and wgmma add up on an SM, so the decode's instruction count is what 32-128 tokens pay.
__device__ __forceinline__ uint32_t split_high_bytes(uint32_t n, uint32_t k38) {
  uint32_t d;
  // LUT 0xEA = (a & b) | c.
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(n), "n"(0x87878787), "r"(k38));
  return d;
}

// Decodes one split-plane vector: 16 L bytes and 2 N words into 8 registers of BF16 pairs in the
// same register order as decode16. k38 as decode16's (keeps the selectors as immediates).
__device__ __forceinline__ void decode16_split(const uint4& l, const uint2& n, uint32_t* a, uint32_t k38 = 0x38383838u) {
  const uint32_t ha0 = split_high_bytes(n.x, k38), hb0 = split_high_bytes(__funnelshift_l(n.x, n.x, 4), k38);
  const uint32_t ha1 = split_high_bytes(n.y, k38), hb1 = split_high_bytes(__funnelshift_l(n.y, n.y, 4), k38);
  a[0] = prmt(l.x, ha0, 0x5140u);
  a[1] = prmt(l.x, ha0, 0x7362u);
  a[2] = prmt(l.y, hb0, 0x5140u);
  a[3] = prmt(l.y, hb0, 0x7362u);
  a[4] = prmt(l.z, ha1, 0x5140u);
  a[5] = prmt(l.z, ha1, 0x7362u);
  a[6] = prmt(l.w, hb1, 0x5140u);
  a[7] = prmt(l.w, hb1, 0x7362u);
}

// 0x38383838 in a register ptxas cannot constant-fold: `zero` must be 0 at run time but unknown
// at compile time (a kernel argument that is always 0 in practice, e.g. M >> 30 for M <= 64).
__device__ __forceinline__ uint32_t opaque_k38(uint32_t zero) { return 0x38383838u | zero; }

// FP32 2^(b - E0) for a row base b in [1, 239], built from its bit pattern (exact, no exp2f).
__device__ __forceinline__ float row_scale(uint32_t b) { return __uint_as_float((b + 127u - kDecodeE0) << 23); }

// The value the fixed-offset decode gives an escape slot (code 0) after row scaling: 2^(b - 127).
__device__ __forceinline__ float escape_slot_value(uint32_t b) { return __uint_as_float(b << 23); }

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// ---- PTX wrappers -------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16/8-byte global->shared async copies, L1 bypassed for the streamed weights (.cg needs 16).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src));
}
// 16-byte copy that writes zeros when !valid (src-size 0): rows past M in the activation tile.
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n));
}
// 16 bytes through L1 (.ca): v4's activation tiles. The CTAs an SM holds at once mostly work on
// the same K slice (blocks b, b + SMs, ... share b % S when S divides the SM count), so their
// tiles are the same bytes and L1 serves all but the first (measured, session 7: v4 +4..13 % at
// 16-64 tokens over .cg; v1's activation copies measured 1-2 % slower through L1 and stay .cg).
__device__ __forceinline__ void cp_async16_ca(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
// The "memory" clobbers keep the compiler from moving ordinary shared-memory reads of a stage
// above the wait that makes that stage's async copies visible.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// D += A(16x16, row) * B(16x8, col), BF16 inputs, FP32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  // Not volatile: a pure function of its operands, so the compiler may interleave it with decode.
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace w12
