"""Fake aiter.jit.utils (a package of the fake aiter)."""
