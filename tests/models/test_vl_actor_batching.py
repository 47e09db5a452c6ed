"""The actor's batching paths on image rollouts, for every vision-language family: padded, packed, token-budget and
shared-prompt micro-batches give transformers' log-probs. Qwen3-VL's DeepStack features are added to the image
placeholder tokens after its first decoder layers, so a micro-batching that put a row's image tokens anywhere but
where the hooks' placeholder mask says would show here, and only for Qwen3-VL."""
from __future__ import annotations

import pytest

from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_vl import VL_FAMILIES, save_tiny_vl
from tests.models.vision_jobs import LOG_PROB_TOLERANCE


@pytest.fixture(scope="module", params=VL_FAMILIES)
def vision_rollout_dir(request, tmp_path_factory):
    from tests.data.vision_assets import save_image_processor

    directory = str(tmp_path_factory.mktemp(request.param) / "hf")
    save_tiny_vl(directory, model_type=request.param)
    save_image_processor(directory)
    return directory


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp", [1, 2])
def test_the_actors_log_probs_on_image_rollouts_equal_transformers(vision_rollout_dir, tp):
    """The driver's batch (images through the processor, M-RoPE positions) through the actor worker, padded, packed,
    in token-budget micro-batches and in shared-prompt ones, equals transformers run one sequence at a time."""
    from tests.models.vision_jobs import ACTOR_LAYOUTS, actor_log_probs_job, hf_rollout_log_probs, vision_rollout

    samples, results, batch = vision_rollout(vision_rollout_dir)
    assert batch.images.per_row.tolist() == [1, 1, 1, 1, 1, 1, 1, 2, 2, 0, 0]
    expected = hf_rollout_log_probs(vision_rollout_dir, samples, results)
    report = run_ranks(actor_log_probs_job, tp, vision_rollout_dir, tp, timeout_s=360)[0]
    for name in ACTOR_LAYOUTS:
        got = report[name]["log_probs"]
        diff = max(abs(got[row, k].item() - value) for row, values in enumerate(expected)
                   for k, value in enumerate(values))
        assert diff < LOG_PROB_TOLERANCE, (name, diff)
    # Each row's images (11) in the row-wise layouts; in shared-prompt ones each prompt's once (5), the red and the
    # blue prompt apart although their tokens are the same.
    for name in ("padded", "packed", "token_budget"):
        assert sum(report[name]["images"]) == 11, (name, report[name])
    assert not any(report["padded"]["packed"]) and all(report["packed"]["packed"])
    assert report["token_budget"]["micro_batches"] > report["packed"]["micro_batches"]
    shared = report["shared_prompts"]
    assert all(shared["shared"]) and sum(shared["images"]) == 5, shared
