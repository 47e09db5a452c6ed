"""Process supervision: what ends every process a run started, however the run itself ended (the reaper for a
session's processes, the lifeline for a launched server group)."""
