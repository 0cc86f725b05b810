"""A stand-in for the part of vllm-ascend that the ftkit plugin meets: its strict
``additional_config`` validation (``ascend_config.init_ascend_config``). vllm-ascend is not
installed here; this package takes its place in the plugin's contract test only."""
