"""Fake aiter.jit (a package of the fake aiter)."""
