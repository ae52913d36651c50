"""Testing support for ckpt's own test suite and benches (not used by the library itself)."""
