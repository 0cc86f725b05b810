"""The ``ftkit`` command: run fault-injection scenarios against vLLM and show the verdicts.

This package is a front end only; the library (``ftkit``) never imports it.
"""

__all__: list[str] = []
