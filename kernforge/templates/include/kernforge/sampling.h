// Sampling kernels (FlashInfer semantics): softmax, top-k / top-p / min-p filtering, renormalization,
// logit masking and inverse-CDF sampling, without sorting the vocabulary. Written once against kf::VecF.
//
// Every filter keeps the entries x >= t of a row for one threshold t:
//   top-k  t = the k-th largest value (ties at t are all kept);
//   top-p  t = the largest value v whose mass(x >= v) reaches p * mass, i.e. x is kept iff the mass
//          of strictly larger entries is < p * mass;
//   min-p  t = min_p * max(x).
// Filters combine by taking the largest threshold. The k-th value comes from a compare pass that
// buffers the few entries above a floor (the k-th largest block maximum); the top-p threshold from a
// bisection over the floats' bit patterns that sums the mass above several pivots per pass and
// shrinks to the surviving candidates. The first pass reads the row from memory; later passes find
// it in L2 (a 128K-entry fp32 row is 512 KiB), so a call costs about one read of its rows plus a few
// passes over L2.
//
// Determinism: rows are cut into fixed chunks; every sum is a per-chunk vector sum, combined in chunk
// order in double. Thresholds are exact, so they depend on the data only. Results are therefore
// bitwise the same for any thread count.
//
// This umbrella includes the whole kernel through its driver. The parts, in kernforge/sampling/:
//   rng.h        Philox4x32-10 and the per-row uniform draw
//   row_stats.h  chunking, per-thread Scratch, the row passes the filters share (row_stats, mass_at_least)
//   top_k.h      the k-th largest value: block-maxima floor, then one buffering compare pass
//   top_p.h      the top-p threshold: bisection over float keys with several pivots per pass
//   row_ops.h    softmax, fp32 conversion, renormalized / masked output rows, the inverse-CDF draw
//   driver.h     arguments (params_from), validation, run_row per action, run over the batch
#pragma once

#include "kernforge/sampling/driver.h"
