"""The ``jax-dflash`` command line (``run``, ``check``): :mod:`jax_dflash.cli.main`."""
