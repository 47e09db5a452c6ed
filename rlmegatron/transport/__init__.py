"""How the driver reaches the processes it runs on: worker groups (in this process, forked processes over pipes, or Ray
actors), the fork server the local ones start from, and `run_ranks` for a function on N local ranks."""
