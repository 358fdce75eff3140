// The bracket proof of the divided stores (numerics.h, "divided stores without their division"),
// host-compiled from the kernel's own functions: wherever bracketed_integer_code or fp8_bracket
// take their code from the products, it must be the code of the division RN(y / s), for every
// reciprocal r the hardware may give (every float with |r s - 1| <= 2^-23, the bound
// tools/rcp_bound_check.cu checks over all s). Quotients sit on and a few ulps either side of
// every boundary of each grid, at random, and at the specials (zeros, infinities, NaN, past the
// grid, past 2^22), for scales across the whole normal range. It also counts how often the
// products stand: away from the boundaries they must, or the stores would divide.
//
//   c++ -std=c++17 -O2 -ffp-contract=off -DDFLASH_BRACKETED_CODES=1 -Icsrc tools/bracket_check.cc \
//     -o /tmp/bracket_check && /tmp/bracket_check [scales]
//
// Exit status 0 when no code differs and the products stand for all but 1/1000 of the random
// quotients; it prints one line per grid.
#include <cfloat>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "dflash/numerics.h"

#if !DFLASH_BRACKETED_CODES
#error "build with -DDFLASH_BRACKETED_CODES=1: the check is of the bracket's code"
#endif

namespace {

using dflash::Divisor;

enum class Grid { kInt8, kInt8Bounded, kInt4Bounded, kE4M3, kE5M2 };
struct GridInfo {
  char const* name;
  float qmax;
  bool bounded;  // a scale-pool row: |y| <= a, s = RN(a / qmax)
};
GridInfo info(Grid g) {
  switch (g) {
    case Grid::kInt8: return {"int8, static scale", 127.0f, false};
    case Grid::kInt8Bounded: return {"int8, scale pool", 127.0f, true};
    case Grid::kInt4Bounded: return {"int4, scale pool", 7.0f, true};
    case Grid::kE4M3: return {"e4m3, scale pool", 448.0f, false};
    case Grid::kE5M2: return {"e5m2, scale pool", 57344.0f, false};
  }
  return {"", 0.0f, false};
}

// The stored code of q = RN(y / s) as the division writes it (numerics.h's conversions).
uint32_t divided_code(Grid g, float q) {
  switch (g) {
    case Grid::kInt8:
    case Grid::kInt8Bounded: return dflash::float_to_int8_bits(q);
    case Grid::kInt4Bounded: return dflash::float_to_int4_bits(q);
    case Grid::kE4M3: return dflash::float_to_e4m3_bits_software(q);
    case Grid::kE5M2: return dflash::float_to_e5m2_bits_software(q);
  }
  return 0;
}

// The code from the bracket, and whether it stands (false: the store divides).
bool bracket_code(Grid g, float y, Divisor const& d, uint32_t* code) {
  bool divide = !d.by_product;
  switch (g) {
    case Grid::kInt8: *code = dflash::bracketed_integer_code<127, false>(y, d, divide) & 0xffu; break;
    case Grid::kInt8Bounded: *code = dflash::bracketed_integer_code<127, true>(y, d, divide) & 0xffu; break;
    case Grid::kInt4Bounded: *code = dflash::bracketed_integer_code<7, true>(y, d, divide) & 0x0fu; break;
    case Grid::kE4M3:
    case Grid::kE5M2: {
      float lo, hi;
      dflash::fp8_bracket(y, d, lo, hi);
      uint32_t const a = g == Grid::kE4M3 ? dflash::float_to_e4m3_bits_software(lo)
                                          : dflash::float_to_e5m2_bits_software(lo);
      uint32_t const b = g == Grid::kE4M3 ? dflash::float_to_e4m3_bits_software(hi)
                                          : dflash::float_to_e5m2_bits_software(hi);
      divide |= a != b;
      *code = a;
      break;
    }
  }
  return !divide;
}

// Every float r with |r s - 1| <= 2^-23 (the product r s is exact in double).
std::vector<float> admissible_reciprocals(float s) {
  std::vector<float> out;
  float const nearest = 1.0f / s;
  auto admitted = [s](float r) { return std::fabs(double(r) * double(s) - 1.0) <= 0x1p-23; };
  float const outward = std::copysign(INFINITY, s);  // away from zero, either sign
  float r = nearest;
  while (admitted(std::nextafter(r, 0.0f))) r = std::nextafter(r, 0.0f);
  for (; admitted(r); r = std::nextafter(r, outward)) out.push_back(r);
  return out;
}

// The grid's rounding boundaries in quotient units (both signs), and its levels.
std::vector<double> boundaries(Grid g) {
  std::vector<double> out;
  GridInfo const gi = info(g);
  if (g == Grid::kE4M3 || g == Grid::kE5M2) {
    std::vector<double> levels;
    for (uint32_t code = 0; code < 0x80; ++code) {
      uint32_t const exponent_bits = g == Grid::kE4M3 ? 4 : 5, mantissa_bits = 7 - exponent_bits;
      int const bias = g == Grid::kE4M3 ? 7 : 15;
      uint32_t const e = code >> mantissa_bits, m = code & ((1u << mantissa_bits) - 1);
      double const v = e == 0 ? std::ldexp(double(m), 1 - bias - int(mantissa_bits))
                              : std::ldexp(1.0 + std::ldexp(double(m), -int(mantissa_bits)), int(e) - bias);
      if (v <= gi.qmax) levels.push_back(v);
    }
    for (size_t i = 0; i + 1 < levels.size(); ++i) {
      double const mid = (levels[i] + levels[i + 1]) / 2;
      out.push_back(mid), out.push_back(-mid), out.push_back(levels[i]), out.push_back(-levels[i]);
    }
  } else {
    for (int k = -int(gi.qmax) - 1; k <= int(gi.qmax); ++k) out.push_back(k + 0.5), out.push_back(k);
  }
  return out;
}

struct Tally {
  uint64_t cases = 0, wrong = 0, random = 0, random_divided = 0;
};

void check(Grid g, float y, float s, std::vector<float> const& reciprocals, bool random, Tally& t) {
  float const q = dflash::div_rn(y, s);
  uint32_t const expected = divided_code(g, q);
  for (float const r : reciprocals) {
    Divisor const d = dflash::divisor_with(s, r);
    uint32_t code = 0;
    bool const stands = bracket_code(g, y, d, &code);
    ++t.cases;
    if (random) ++t.random, t.random_divided += !stands;
    if (stands && code != expected) {
      if (++t.wrong <= 10)
        std::printf("  WRONG %s: y=%a s=%a r=%a q=%a code %#x, division %#x\n", info(g).name, double(y),
                    double(s), double(r), double(q), code, expected);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int const scales = argc > 1 ? std::atoi(argv[1]) : 400;
  std::mt19937_64 rng(20261204);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  int failed = 0;
  for (Grid g : {Grid::kInt8, Grid::kInt8Bounded, Grid::kInt4Bounded, Grid::kE4M3, Grid::kE5M2}) {
    GridInfo const gi = info(g);
    std::vector<double> const edges = boundaries(g);
    Tally t;
    for (int n = 0; n < scales; ++n) {
      // The row maximum a (bounded grids: s = RN(a / qmax)) or the scale itself: random normal
      // floats across the range, with powers of two and the range's ends among them.
      int const exponent = n % 7 == 0 ? -125 + n % 250 : int(unit(rng) * 250.0) - 125;
      float magnitude = float(std::ldexp(1.0 + (n % 5 == 0 ? 0.0 : unit(rng)), exponent));
      if (n == 1) magnitude = FLT_MIN;
      if (n == 2) magnitude = 0x1.fffffep124f;
      // A static scale may be negative (every other scale of each grid is, for int8).
      float const sign = g == Grid::kInt8 && n % 2 == 1 ? -1.0f : 1.0f;
      float const s = gi.bounded ? dflash::div_rn(magnitude, gi.qmax) : sign * magnitude;
      if (!(std::fpclassify(s) == FP_NORMAL) || std::fabs(s) >= 0x1p125f)
        continue;  // those divide (rcp_bound_check)
      float const limit = gi.bounded ? magnitude : INFINITY;  // a bounded row's elements: |y| <= a
      std::vector<float> const reciprocals = admissible_reciprocals(s);
      auto try_y = [&](float y, bool random) {
        if (std::fabs(y) <= limit || std::isnan(y)) check(g, y, s, reciprocals, random, t);
      };
      for (double const e : edges) {  // on and beside each boundary
        float const at = float(e * double(s));
        float up = at, down = at;
        try_y(at, false);
        for (int k = 0; k < 4; ++k) {
          up = std::nextafter(up, INFINITY), down = std::nextafter(down, -INFINITY);
          try_y(up, false), try_y(down, false);
        }
      }
      for (int k = 0; k < 2000; ++k) try_y(float((unit(rng) * 2.4 - 1.2) * gi.qmax * double(s)), true);
      if (gi.bounded) try_y(magnitude, false), try_y(-magnitude, false);
      for (float const special :
           {0.0f, -0.0f, INFINITY, -INFINITY, NAN, FLT_MAX, -FLT_MAX, 0x1p-149f, -0x1p-149f, FLT_MIN,
            float(0x1p22 * double(s)), float(-0x1p22 * double(s)), float(0x1p23 * double(s)),
            float(-0x1p24 * double(s)), float(0x1p40 * double(s))})
        try_y(special, false);
    }
    double const divided = t.random ? double(t.random_divided) / double(t.random) : 1.0;
    bool const ok = t.wrong == 0 && t.random > 0 && divided <= 1e-3;
    failed |= !ok;
    std::printf("%-20s %s: %" PRIu64 " cases, %" PRIu64 " wrong codes; random quotients divided: %.2e\n",
                gi.name, ok ? "ok" : "FAILED", t.cases, t.wrong, divided);
  }
  return failed;
}
