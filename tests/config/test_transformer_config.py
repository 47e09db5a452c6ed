"""`extra` costs no megatron import while it is empty."""
import subprocess
import sys

import pytest

from tests.config.specs import REPO_ROOT


@pytest.mark.parametrize("extra, imported", [("", False), ("actor.megatron.extra.hidden_dropout=0.1", True)])
def test_megatron_is_imported_to_vet_extra_only_when_extra_is_set(extra, imported):
    probe = (
        "import sys; from rlmegatron.prelaunch.spec_pipeline import load_spec; "
        f"load_spec('configs/quickstart.yaml', {[extra] if extra else []!r}); print('megatron' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(imported)
