"""``python -m jax_dflash`` and the ``jax-dflash`` console script (see jax_dflash.cli)."""

from __future__ import annotations

import sys

from jax_dflash.cli import main

if __name__ == "__main__":
    sys.exit(main())
