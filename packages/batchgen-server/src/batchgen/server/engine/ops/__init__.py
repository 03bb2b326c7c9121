"""Kernels and the rule of their fast paths: native C++ operators built on first use, host-to-device transfers, the
packed CPU linear, the compiled layers."""
