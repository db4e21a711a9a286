// Vectorized fp32 math written once against the kf::VecF interface, so every tier shares the same
// algorithms and constants. gcc has no SVML, hence the polynomial approximations. Accuracy over
// dense sweeps (see the accuracy notes at each function) is a few ulp; special values follow libm:
// NaN in -> NaN out, overflow -> Inf, underflow -> gradual (subnormal) then 0.
#pragma once

// Included by kernforge/core/vec.h after the tier's VecF definition.

namespace kf {

namespace math_detail {
// c[0] + c[1] x + c[2] x^2 + ... by Horner's rule with fused multiply-adds.
template <int N>
inline VecF polynomial(VecF x, const float (&c)[N]) {
  VecF acc = VecF::broadcast(c[N - 1]);
  for (int i = N - 2; i >= 0; --i) acc = fma(acc, x, VecF::broadcast(c[i]));
  return acc;
}
}  // namespace math_detail

// e^x: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-5 minimax polynomial (fitted for this
// library; 1.1e-7 relative on the interval), then scaled by 2^n. Max relative error 1.8e-7 on
// [-87, 88]. Kept short on purpose: exp is the whole cost of SiLU, which must stay memory-bound.
inline VecF exp(VecF x) {
  // Beyond these bounds the result is Inf or 0 anyway; clamping keeps n in ldexp's range.
  x = clamp(x, VecF::broadcast(-104.0f), VecF::broadcast(88.8f));
  const VecF n = rint(x * VecF::broadcast(1.44269504088896341f));
  // Cody-Waite: ln2 = kLn2Hi + kLn2Lo with kLn2Hi = 0.693359375 (9 significant bits), so n * kLn2Hi
  // is exact and r keeps full precision even for |n| ~ 128.
  const VecF r = fma(n, VecF::broadcast(2.12194440e-4f), fma(n, VecF::broadcast(-0.693359375f), x));
  static constexpr float kExpR[] = {1.0f, 1.0f, 4.999923110e-01f, 1.666711420e-01f, 4.189011455e-02f, 8.312525228e-03f};
  return ldexp(math_detail::polynomial(r, kExpR), n);
}

// erf(x), two regions fitted for this library (minimax, Lawson's algorithm):
//   |x| < 1:      x * P(x^2)           (relative error, keeps tiny |x| accurate)
//   1 <= |x| < 4: Q(|x| - 2.5)          (absolute error 5e-8 where erf >= 0.84)
//   |x| >= 4:     +-1                   (erfc(4) = 1.5e-8 is below fp32 resolution at 1)
// Max relative error ~2e-7.
inline VecF erf(VecF x) {
  static constexpr float kInner[] = {1.128379107e+00f,  -3.761232495e-01f, 1.128017977e-01f,
                                     -2.671131119e-02f, 4.917551298e-03f,  -5.631421809e-04f};
  static constexpr float kOuter[] = {9.995930791e-01f,  2.178021008e-03f,  -5.447186995e-03f, 8.353904821e-03f,
                                     -8.612042293e-03f, 6.101185922e-03f,  -2.825388685e-03f, 5.729147815e-04f,
                                     2.935914090e-04f,  -2.802539384e-04f, 5.871366739e-05f,  2.129921813e-05f,
                                     -8.595768122e-06f};
  const VecF one = VecF::broadcast(1.0f);
  const VecF a = abs(x);
  const VecF inner = x * math_detail::polynomial(x * x, kInner);
  const VecF outer = math_detail::polynomial(a - VecF::broadcast(2.5f), kOuter);
  // A NaN fails every comparison and falls through to `outer`, which is NaN.
  const VecF magnitude = select(VecF::broadcast(4.0f) < a, one, outer);
  return select(a < one, inner, copysign(magnitude, x));
}

// tanh(x). Cephes tanhf: |x| < 0.625: x + x^3 P(x^2); otherwise 1 - 2 / (e^{2|x|} + 1), which
// saturates to exactly +-1 once e^{2|x|} overflows. The sign is x's (tanh(-0) = -0: the small
// branch alone gives +0 there). Max relative error ~2e-7.
inline VecF tanh(VecF x) {
  static constexpr float kSmall[] = {-3.33332819422e-1f, 1.33314422036e-1f, -5.37397155531e-2f, 2.06390887954e-2f,
                                     -5.70498872745e-3f};
  const VecF one = VecF::broadcast(1.0f);
  const VecF a = abs(x);
  const VecF x2 = x * x;
  const VecF small = fma(x * x2, math_detail::polynomial(x2, kSmall), x);
  const VecF large = one - VecF::broadcast(2.0f) / (exp(a + a) + one);
  return copysign(select(a < VecF::broadcast(0.625f), small, large), x);
}

// 1 / (1 + e^-x), without cancellation for either sign.
inline VecF sigmoid(VecF x) { return VecF::broadcast(1.0f) / (VecF::broadcast(1.0f) + exp(-x)); }

}  // namespace kf
