"""Measurements behind `pyfast bench ...`; the pytest-benchmark suites in bench/ reuse them."""
