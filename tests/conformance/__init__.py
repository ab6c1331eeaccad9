"""Opt-in conformance tests against AWS's own kernels (a package so its conftest has a unique module name)."""
