// The fused optimizers' kernels in three builds. Each build is fused_kernel_body.inc compiled
// inside a `#pragma GCC target` region, with the intrinsics of that instruction set in a struct
// V; the region's functions are the only ones built for that set, and ATen's choice
// (ATEN_CPU_CAPABILITY) caps which one runs. Hand-written because libtorch offers no fused CPU
// optimizer before 2.4 and none to C++ at all (torch::optim::Adam is several passes over
// memory: ~80 bytes per parameter against 28 here).

#include "fused_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

// The vector builds need GCC's target pragmas (clang spells them otherwise): elsewhere, the scalar
// build alone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PARATRAIN_FUSED_X86 1
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

namespace paratrain {
namespace optim {
namespace detail {
namespace {

// One element at a time: std::fma and IEEE sqrt and division round as the vector instructions
// do, so a tail (or the scalar build) gives the bits a vector lane would.
struct Scalar {
  static constexpr int kWidth = 1;
  using T = float;
  static T load(const float* p) { return *p; }
  static void store(float* p, T x) { *p = x; }
  static T set1(float x) { return x; }
  static T add(T a, T b) { return a + b; }
  static T mul(T a, T b) { return a * b; }
  static T div(T a, T b) { return a / b; }
  static T sqrt(T a) { return std::sqrt(a); }
  // NaN from either side, as ATen's maximum and the vector builds.
  static T max(T a, T b) { return std::isnan(b) ? b : (a > b || std::isnan(a) ? a : b); }
  static T fma(T a, T b, T c) { return std::fma(a, b, c); }  // a * b + c, rounded once
  static void store_bf16(uint16_t* p, T x) { *p = c10::BFloat16(x).x; }
  static void store_half(uint16_t* p, T x) { *p = c10::Half(x).x; }
};

namespace scalar {
using V = Scalar;
#include "fused_kernel_body.inc"
}  // namespace scalar

#if defined(PARATRAIN_FUSED_X86)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct V {
  static constexpr int kWidth = 8;
  using T = __m256;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T sqrt(T a) { return _mm256_sqrt_ps(a); }
  // max(a, b) that keeps b's NaN, as ATen's maximum propagates NaN.
  static T max(T a, T b) {
    const T nan_b = _mm256_cmp_ps(b, b, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_max_ps(b, a), b, nan_b);
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  // Round to nearest even, NaN to 0x7FC0: c10::BFloat16's rounding.
  static void store_bf16(uint16_t* p, T x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // Eight 32-bit lanes to eight 16-bit ones (packus works within each 128-bit half).
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store_half(uint16_t* p, T x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
#include "fused_kernel_body.inc"
}  // namespace avx2
#pragma GCC pop_options

// GCC 12 reads the deliberately undefined first operand of its own AVX512 intrinsics
// (_mm512_undefined_*) as uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
struct V {
  static constexpr int kWidth = 16;
  using T = __m512;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T sqrt(T a) { return _mm512_sqrt_ps(a); }
  static T max(T a, T b) {
    const __mmask16 nan_b = _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_max_ps(b, a), nan_b, b);
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void store_bf16(uint16_t* p, T x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store_half(uint16_t* p, T x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
#include "fused_kernel_body.inc"
}  // namespace avx512
#pragma GCC pop_options
#pragma GCC diagnostic pop

const Kernels kScalar{"scalar", scalar::adam_range, scalar::sgd_range};
const Kernels kAvx2{"avx2", avx2::adam_range, avx2::sgd_range};
const Kernels kAvx512{"avx512", avx512::adam_range, avx512::sgd_range};
#else
const Kernels kScalar{"scalar", scalar::adam_range, scalar::sgd_range};
const Kernels kAvx2{"avx2", scalar::adam_range, scalar::sgd_range};      // never chosen
const Kernels kAvx512{"avx512", scalar::adam_range, scalar::sgd_range};  // never chosen
#endif

bool cpu_runs(const Kernels& k) {
#if !defined(PARATRAIN_FUSED_X86)
  return &k == &kScalar;
#else
  __builtin_cpu_init();
  if (&k == &kAvx512) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  if (&k == &kAvx2) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  return true;
#endif
}

const Kernels& choose() {
  // ATen's names: "default", "avx2", "avx512" (and later "avx512_vnni", "avx512_bf16", ...).
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  const std::string cap_s = cap != nullptr ? cap : "";
  if (cap_s == "default") {
    return kScalar;
  }
  if (cap_s.rfind("avx512", 0) == 0 || cap_s.empty() || cap_s == "amx") {
    if (cpu_runs(kAvx512)) {
      return kAvx512;
    }
  }
  return cpu_runs(kAvx2) ? kAvx2 : kScalar;
}

}  // namespace

const Kernels& kernels() {
  static const Kernels& chosen = choose();
  return chosen;
}

const Kernels& kernels_for(const char* isa) {
  for (const Kernels* k : {&kAvx512, &kAvx2, &kScalar}) {
    if (std::strcmp(k->isa, isa) == 0) {
      TORCH_CHECK(cpu_runs(*k), "fused optimizer: this CPU cannot run the ", isa, " kernels");
      return *k;
    }
  }
  TORCH_CHECK(false, "fused optimizer: no '", isa,
              "' kernels; the builds are avx512, avx2, scalar");
}

}  // namespace detail
}  // namespace optim
}  // namespace paratrain
