#!/usr/bin/env python3
"""The DFlash KV-update benchmark: see bench/dflash_bench/ (its package docstring).

python bench/bench_kv_update.py                  # GPU when JAX sees one, else scaled-down CPU
python bench/bench_kv_update.py --backend cpu --quick
python bench/bench_kv_update.py --shapes decode_b64,prefill_b8_l2048 --out /tmp/results
"""

import sys

from dflash_bench import main

if __name__ == "__main__":
    sys.exit(main())
