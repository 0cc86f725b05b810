"""Everything that knows vLLM internals; nothing else in ftkit imports vLLM."""
