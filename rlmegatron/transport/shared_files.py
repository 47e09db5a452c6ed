"""What a Ray member on any node must share with the driver: its working directory (relative paths of the spec, and
plug-ins named by relative path, resolve there) and the run directory (checkpoints, engine logs, the exported
policy), on a filesystem every node mounts at the same path.

A member of a cluster Ray was started on apart from this run (`ray start`, launch/local_cluster.sh, a Slurm job)
starts in its raylet's directory, not the driver's; it moves to the driver's, and reads a token the driver wrote into
the run directory for this run. A node without either is one line naming it, not a model that fails to load, or
checkpoints written to a disk no other node reads.
"""
from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from rlmegatron.errors import UserError

MARK = ".shared_by_every_node"


class NotShared(UserError):
    """A node of the cluster does not see the driver's working directory or the run directory."""


@dataclass(frozen=True)
class SharedFiles:
    workdir: str
    run_dir: str
    token: str

    @classmethod
    def write(cls, run_dir: str) -> SharedFiles:
        """The driver's side: a fresh token in the run directory (made if need be)."""
        token = secrets.token_hex(8)
        path = Path(run_dir).resolve()
        path.mkdir(parents=True, exist_ok=True)
        (path / MARK).write_text(token)
        return cls(os.getcwd(), str(path), token)

    def enter(self, where: str) -> None:
        """A member's side, before its object is built: into the driver's directory, which also goes on the import
        path as the driver has it; NotShared naming `where` (this member's node) if it or the run directory is not
        the driver's."""
        fix = ("every node needs the run's files at the same path: run from a directory on a filesystem all nodes "
               "mount (NFS, Lustre, ...), and put trainer.run_dir on one")
        try:
            os.chdir(self.workdir)
        except OSError:
            raise NotShared(f"node {where} has no directory {self.workdir} (where rlm train runs); {fix}") from None
        if self.workdir not in sys.path:
            sys.path.insert(0, self.workdir)
        try:
            seen = (Path(self.run_dir) / MARK).read_text()
        except OSError:
            seen = None
        if seen != self.token:
            found = "is not there" if seen is None else "holds another run's token"
            raise NotShared(f"node {where} does not see trainer.run_dir={self.run_dir} as the driver does (its "
                            f"{MARK} {found}); {fix}")
