"""The suite's float32 tolerances, derived from what the tests claim.

An accumulated result and the full-batch one are the same sums taken in a
different order (per micro-batch, then over micro-batches), and the same
forward pass on batches of another shape, so the claim is equality up to
float32 rounding. Rounding differs between CPUs (XLA picks its vector code,
and with it the summation order and the fused multiply-adds, from the host):
a tolerance is a bound on that rounding, never a figure read off one machine.

- Summing ``n`` terms in float32, in any order, errs by at most
  ``(n - 1) u sum|t_i|`` (``u = 2**-24``, the unit roundoff; Higham,
  "Accuracy and Stability of Numerical Algorithms", 4.2); two orders differ by
  at most twice that.
- Two such stages meet in a gradient: the contractions of the forward and
  backward pass (over features) and the sum over the batch. The tests' sums
  have at most ``MAX_TERMS`` terms in each.
- So a coordinate whose terms do not cancel agrees to ``RTOL``; one whose
  terms cancel agrees to ``RTOL * sum|t_i|``, and the tests' data is of unit
  scale (normal inputs, weights ``1 / sqrt(fan_in)``), so the mean of the
  per-example gradients' magnitudes is at most about 1 and ``ATOL = RTOL``
  covers it.

A real mistake (a micro-batch counted twice or not at all, a loss scaled by N,
an optimizer stepped per micro-batch) moves results by 1e-2 and more.
"""

UNIT_ROUNDOFF = 2.0**-24  # float32
MAX_TERMS = 64  # rows per batch, features per contraction, in the tests
RTOL = 2 * (2 * MAX_TERMS * UNIT_ROUNDOFF)  # two stages of two orders: 1.5e-5
ATOL = RTOL  # times sum|t_i| <= 1 on unit-scale data

# The same bound in float64 (u = 2**-53), for windows whose claim is float64
# equality (tests/test_float64.py): 2.8e-14. A share rounded to float32 moves
# a float64 gradient by about 3e-8.
UNIT_ROUNDOFF_64 = 2.0**-53
RTOL64 = 2 * (2 * MAX_TERMS * UNIT_ROUNDOFF_64)
ATOL64 = RTOL64

# bfloat16 outputs (8 significant bits, u = 2**-8): two paths round values
# that differ by float32 rounding to bfloat16, which can land them one ulp
# (2 u) apart; a result computed from them agrees to that, relative, and to
# twice it where two such values meet (a product of two embeddings): 1.6e-2.
# A real mistake (a row lost of 32, a micro-batch counted twice) moves
# results by 3e-2 and more.
UNIT_ROUNDOFF_BF16 = 2.0**-8
RTOL_BF16 = 2 * (2 * UNIT_ROUNDOFF_BF16)
ATOL_BF16 = RTOL_BF16  # times sum|t_i| <= 1 on unit-scale data, as above
