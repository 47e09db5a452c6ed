"""configs/gsm8k_cpu_smoke.yaml: `rlm prepare gsm8k` on the GSM8K slice the repository ships (configs/gsm8k_sample:
the first 48 train and 16 test rows of the original release, as the README's commands use it), then three GRPO steps
end to end on CPU."""
import sys
from pathlib import Path

from tests.helpers import warm_runs

REPO_ROOT = Path(__file__).resolve().parents[2]
GSM8K = REPO_ROOT / "configs" / "gsm8k_sample"


def test_three_grpo_steps_on_real_gsm8k(tmp_path):
    data = tmp_path / "data"
    rlm = [sys.executable, "-m", "rlmegatron"]
    # Forked warm from the suite's fork server (tests/helpers/warm_runs.py): the commands, not their imports, are tested.
    prepared = warm_runs.run([*rlm, "prepare", "gsm8k", "--src", str(GSM8K), "--out", str(data)], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stdout[-3000:] + prepared.stderr[-3000:]
    run = warm_runs.run(
        [*rlm, "train", "configs/gsm8k_cpu_smoke.yaml", f"trainer.run_dir={tmp_path / 'run'}",
         f"data.train_files=[{data / 'train.parquet'}]"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "trained steps 1-3 (3 steps) in " in run.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_3").is_dir()
    assert (tmp_path / "run" / "hf_policy" / "model.safetensors.index.json").is_file()
