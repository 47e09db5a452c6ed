"""Loopback stand-in for sglang_router (see launch_router.py)."""
