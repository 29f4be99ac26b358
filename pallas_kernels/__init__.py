"""Pallas kernels for the hot paths of diffspec-jax (gather-RoPE-write, chunk scoring, draft attention).

Each kernel lives next to a pure-JAX reference with the same signature; see the DiffSpec and Pallas issues.
"""
