#!/usr/bin/env python3
"""The benchmark of issue 4: see jax_dflash/benchmark.py (also `jax-dflash bench`).

  python bench/bench_kv_update.py                  # GPU when JAX sees one, else scaled-down CPU
  python bench/bench_kv_update.py --backend cpu --quick
  python bench/bench_kv_update.py --shapes decode_b64,prefill_b8_l2048 --out /tmp/results
"""

import sys

from jax_dflash.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
