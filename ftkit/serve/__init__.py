"""ftkit in a vLLM server: its routes (fault injection, health, metrics) and how to start one."""
