"""The local engine generates from image+text prompts as transformers does: greedy tokens equal transformers'
generate with the same pixels, the log-probs its forward's; prompts told apart by their images; weight updates
under the checkpoint's (and SGLang's) names."""
from __future__ import annotations

import pytest
import torch

from tests.models.tiny_vl import VL_FAMILIES


@pytest.fixture(scope="module", params=VL_FAMILIES)
def vision_engine(tmp_path_factory, request):
    from rlmegatron.rollout.local import LocalEngine, causal_lm_from_config, image_processor_at
    from tests.data.vision_assets import save_image_processor
    from tests.models.tiny_vl import save_tiny_vl
    from tests.models.vision_jobs import vision_rollout
    from transformers import AutoConfig

    directory = str(tmp_path_factory.mktemp("vl_engine") / "hf")
    save_tiny_vl(directory, seed=1, model_type=request.param)
    save_image_processor(directory)
    model = causal_lm_from_config(AutoConfig.from_pretrained(directory), torch.float32, False)
    engine = LocalEngine(model, image_processor=image_processor_at(directory))
    from safetensors.torch import load_file

    engine.update_weights(load_file(f"{directory}/model.safetensors").items(), "loaded")
    samples, _, _ = vision_rollout(directory)
    prompts = list({id(s): s for s in samples}.values())  # the five distinct prompts
    return directory, engine, prompts


def test_greedy_generation_with_images_is_transformers_generate(vision_engine):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
    from tests.models.tiny_vl import IMAGE_TOKEN
    from tests.models.vision_jobs import _decode

    directory, engine, prompts = vision_engine
    greedy = SamplingSpec(n=2, temperature=0.0, max_new_tokens=5)
    results = engine.generate([GenerationRequest(tuple(p.prompt_ids), greedy, images=p.images) for p in prompts])
    assert engine.weight_version == "loaded" and len(results) == 2 * len(prompts)
    reference = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(directory)
    outputs = []
    for prompt, result in zip(prompts, results[::2]):
        tokens = torch.tensor([prompt.prompt_ids])
        extra = {}
        if prompt.images is not None:
            pixels = processor(images=[_decode(d) for d in prompt.images.data], return_tensors="pt")
            extra = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        expected = reference.generate(input_ids=tokens, mm_token_type_ids=(tokens == IMAGE_TOKEN).int(),
                                      max_new_tokens=5, do_sample=False, **extra)[0, tokens.shape[1]:]
        assert list(result.output_token_ids) == expected.tolist(), prompt.index
        whole = torch.cat([tokens[0], expected])[None]
        with torch.no_grad():
            logits = reference(input_ids=whole, mm_token_type_ids=(whole == IMAGE_TOKEN).int(), **extra).logits
        log_probs = torch.log_softmax(logits[0, tokens.shape[1] - 1:-1].double(), -1).gather(-1, expected[:, None])
        assert max(abs(a - b) for a, b in zip(result.output_token_logprobs, log_probs[:, 0].tolist())) < 1e-5
        outputs.append(result.output_token_logprobs)
    # The red and the blue prompt have the same tokens: only their pixels differ, and so do their answers' odds.
    assert prompts[0].prompt_ids == prompts[1].prompt_ids and outputs[0] != outputs[1]
    assert [r.output_token_ids for r in results[::2]] == [r.output_token_ids for r in results[1::2]]


def test_a_request_with_images_needs_the_image_processor(vision_engine):
    from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
    from rlmegatron.rollout.local import LocalEngine

    _, engine, prompts = vision_engine
    without = LocalEngine(engine.model)
    with pytest.raises(ValueError, match="no image processor"):
        without.generate([GenerationRequest(tuple(prompts[0].prompt_ids), SamplingSpec(max_new_tokens=1),
                                            images=prompts[0].images)])
