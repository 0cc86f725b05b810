"""ftkit's benchmark suite: ``make bench`` (``python -m benchmarks``); see ``__main__``."""
