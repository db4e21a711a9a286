// Random numbers for the sampling kernels: Philox4x32-10 and the uniform double each sampled row
// draws from it. Counter-based, so a row's draw depends on (seed, offset, row) only, never on the
// thread that makes it or the order rows run in.
#pragma once

#include <cstdint>
#include <cstring>

namespace kf::sampling {

// Philox4x32-10 (Salmon et al., SC'11): a counter-based generator, so every (seed, offset, row)
// gets its own stream no matter which thread draws it.
inline void philox4x32_10(uint32_t counter[4], const uint32_t key_in[2]) {
  uint32_t key[2] = {key_in[0], key_in[1]};
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * counter[0];
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * counter[2];
    const uint32_t next[4] = {uint32_t(p1 >> 32) ^ counter[1] ^ key[0], uint32_t(p1),
                              uint32_t(p0 >> 32) ^ counter[3] ^ key[1], uint32_t(p0)};
    std::memcpy(counter, next, sizeof(next));
    key[0] += 0x9E3779B9u;
    key[1] += 0xBB67AE85u;
  }
}

// A uniform double in [0, 1) with 53 random bits.
inline double uniform(uint64_t seed, uint64_t offset, uint64_t row) {
  uint32_t counter[4] = {uint32_t(row), uint32_t(row >> 32), uint32_t(offset), uint32_t(offset >> 32)};
  const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  philox4x32_10(counter, key);
  const uint64_t bits = (uint64_t(counter[0]) << 21) | (counter[1] >> 11);
  return double(bits) * 0x1p-53;
}

}  // namespace kf::sampling
