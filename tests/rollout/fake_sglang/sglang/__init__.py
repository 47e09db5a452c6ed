"""Stand-in `sglang` package: the tests put it on PYTHONPATH so `python -m sglang.launch_server` starts the fake server."""
