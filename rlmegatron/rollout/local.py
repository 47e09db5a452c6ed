"""In-process rollout engine: batched, KV-cached generation with a transformers causal LM on CPU or GPU."""
from __future__ import annotations

import contextlib
import inspect
import re

from typing import Callable, Sequence

import torch
from torch import nn

from rlmegatron.data.images import pixel_values
from rlmegatron.models.families import family_for
from rlmegatron.models.mrope import mrope_position_ids
from rlmegatron.models.fp8 import FP8, SCALE_SUFFIX, BlockFP8
from rlmegatron.rollout.delta import digest
from rlmegatron.rollout.mtp_draft import MTPDraft
from rlmegatron.rollout.sampling import RequestSample, filter_for_samples, prompt_batch, raise_if_not_finite
from rlmegatron.rollout.speculative import SpeculativeDecoder
from rlmegatron.rollout.buckets import FlattenedBucket
from rlmegatron.rollout.engine import (
    MEMORY_TAGS,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    WeightStream,
    check_memory_tags,
)
from rlmegatron.tracking.progress import Progress, report


def causal_lm_from_config(config, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    """The generating model of `config`: transformers' image-text-to-text class for a vision-language model (its
    causal-LM class has none), else its causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    return auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def image_processor_at(path: str):
    """The image processor in `path` (preprocessor_config.json), None for a text-only model."""
    from pathlib import Path

    if not Path(path, "preprocessor_config.json").is_file():
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path)


# The data's reader checked every image against data.max_image_pixels; the engine takes them as they come.
_ANY_SIZE = 1 << 62

# A seeded sample's noise comes ahead for as many tokens as fit in this many numbers (see _Noise): one call's overhead
# on the CPU costs as much as drawing a few hundred numbers, so drawing further ahead saves nothing (benchmarks/RESULTS.md, "Measured reasons in the code").
_NOISE_AHEAD = 512


class _Noise:
    """The uniforms of the Gumbel-max draw, one row of the vocabulary per sample and token: a seeded sample's from its
    own generator, in the order of its tokens, so they do not depend on its batch; the others' from the engine's."""

    def __init__(self, samples: list[RequestSample], vocabulary: int, generator: torch.Generator) -> None:
        self.samples, self.vocabulary, self.generator = samples, vocabulary, generator
        longest = max(s.sampling.max_new_tokens for s in samples)
        # The CPU generator is a serial Mersenne twister: one draw of [tokens, vocabulary] is the same numbers as one
        # draw per token, so a seeded sample's noise for several tokens comes from one call, less than half the time
        # of a call per sample and token (benchmarks/RESULTS.md, "Measured reasons in the code"). A GPU's Philox
        # generator numbers its draws by call: one token per call there keeps the stream.
        self.ahead = min(longest, max(1, _NOISE_AHEAD // vocabulary)) if generator.device.type == "cpu" else 1
        self.block: torch.Tensor | None = None

    def __call__(self, position: int, rows: list[int]) -> torch.Tensor:
        """[len(rows), vocabulary] float64 for token `position` of the samples in `rows`, the rows still sampling: a
        row leaves for good once its sample ends, and is called for at every token until then."""
        shared = [i for i, row in enumerate(rows) if self.samples[row].generator is None]
        if len(shared) == len(rows):
            return torch.rand((len(rows), self.vocabulary), generator=self.generator, dtype=torch.float64,
                              device=self.generator.device)
        step = position % self.ahead
        if step == 0:
            self.block = torch.empty((len(self.samples), self.ahead, self.vocabulary), dtype=torch.float64,
                                     device=self.generator.device)
            per_row = self.block.unbind()  # one call for the 64 views of the echo task's rows, not one each
            for row in rows:
                generator = self.samples[row].generator
                if generator is not None:
                    per_row[row].uniform_(generator=generator)
        uniform = self.block[:, step] if len(rows) == len(self.samples) else self.block[rows, step]
        if shared:
            # The rows without a seed in one draw: on the CPU the same numbers, in row order, as one draw per row.
            uniform[shared] = torch.rand((len(shared), self.vocabulary), generator=self.generator,
                                         dtype=torch.float64, device=self.generator.device)
        return uniform


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
# What transformers 5 keeps under a MoE layer's `mlp.` in memory, which a family's checkpoint may hold under another
# module name (Mixtral's and MiniMax-M2's block_sparse_moe.).
_MOE_MEMBERS = re.compile(r"^(.*\.layers\.\d+\.)mlp\.(gate\.|experts\.|e_score_correction_bias$)")


def checkpoint_named_weights(model: nn.Module, draft: "MTPDraft | None" = None) -> dict[str, torch.Tensor]:
    """The model's tensors under HF checkpoint names, sharing storage with its parameters; with `draft`, its MTP
    layer's too.

    transformers 5 keeps MoE experts stacked in memory (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]) while checkpoints, and so the export stream, name them per
    expert; those names map to views into the stacked tensors.
    """
    # transformers 5 nests a vision-language model's parts in memory (model.language_model., model.visual.); its
    # checkpoints, and so the export stream, name them as the family's weight map does (Qwen2.5-VL flat as Qwen
    # ships it, Qwen3-VL nested as well).
    family = family_for(getattr(getattr(model, "config", None), "model_type", None))
    nested_parts = (("model.language_model.", family.hf_language_prefix), ("model.visual.", family.hf_vision_prefix),
                    ("lm_head.", family.hf_lm_head.removesuffix("weight")))
    gate_name, up_name, down_name = family.expert_projections
    named = {}
    held = [*model.state_dict().items(), *(draft.checkpoint_tensors().items() if draft is not None else ())]
    for name, tensor in held:
        for nested, checkpoint in nested_parts:
            if name.startswith(nested):
                name = checkpoint + name[len(nested):]
        if family.moe_block != "mlp":
            name = _MOE_MEMBERS.sub(rf"\1{family.moe_block}.\2", name)
        # gpt-oss's checkpoints, and so its syncs, hold the experts stacked as the model does.
        match = None if family.stacked_experts_only else _STACKED_EXPERTS.match(name)
        if match is None:
            named[name] = tensor
            continue
        prefix, kind = match.groups()
        for expert, slab in enumerate(tensor):
            if kind == "down_proj":
                named[f"{prefix}.{expert}.{down_name}.weight"] = slab
            else:
                gate, up = slab.chunk(2, dim=0)
                named[f"{prefix}.{expert}.{gate_name}.weight"] = gate
                named[f"{prefix}.{expert}.{up_name}.weight"] = up
    return named


class _RouterRecorder:
    """While a batch generates: each model call's expert ids from every MoE layer's router, [call's rows x tokens,
    MoE layers, k] (the prefill's rows are the batch's distinct prompts, left-padded; each decode's, its samples)."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.routers = routers
        self.calls: list[torch.Tensor] = []
        self._layers: list[torch.Tensor] = []
        self._hooks: list = []

    def __enter__(self) -> "_RouterRecorder":
        self._hooks = [router.register_forward_hook(self._took) for router in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()

    def _took(self, module, args, output) -> None:
        ids = output[-1]
        if ids.is_floating_point():
            raise TypeError(f"{type(module).__name__} does not return its expert ids last; routing cannot be recorded")
        self._layers.append(ids.reshape(-1, ids.shape[-1]))
        if len(self._layers) == len(self.routers):  # the model call's last MoE layer
            self.calls.append(torch.stack(self._layers, dim=1))
            self._layers = []

    def per_sample(self, prompt_of: list[int], padding: list[int], output_lengths: list[int]) -> list[torch.Tensor]:
        """Each sample's [prompt + output - 1, MoE layers, k] int16: its prompt's tokens from the prefill, then each
        output token but the last from the decode call that fed it back."""
        prefill = self.calls[0].unflatten(0, (len(padding), -1))
        decodes = self.calls[1:]
        return [torch.cat([prefill[prompt, padding[prompt]:], *(decodes[step][row : row + 1]
                                                                 for step in range(length - 1))])
                .to(device="cpu", dtype=torch.int16)
                for row, (prompt, length) in enumerate(zip(prompt_of, output_lengths))]


class LocalEngine(RolloutEngine):
    """Generation with an HF `AutoModelForCausalLM`.

    Log-prob convention (SGLang's `output_token_logprobs`, which verl and slime consume): the sampled
    token's log-softmax of logits / temperature, before top-k/top-p filtering and without renormalising
    over the kept tokens; greedy (temperature 0) reports log-softmax of the raw logits.
    """

    def __init__(
        self,
        model: nn.Module,
        pad_token_id: int = 0,
        eos_token_ids: Sequence[int] = (),
        max_batch_size: int = 64,
        seed: int = 0,
        weight_format: BlockFP8 | None = None,
        image_processor=None,
        num_draft_tokens: int = 0,
    ) -> None:
        """`eos_token_ids` always end a sample with reason `stop`, as the model's EOS does in SGLang.
        `num_draft_tokens` > 0: MTP speculative decoding (rollout.speculative, rollout/speculative.py), the model's
        first MTP layer drafting that many tokens per verification; the engine then holds that layer and takes its
        weights.
        `image_processor`: a vision-language model's (image_processor_at), which requests with images need.
        `weight_format`: the block-wise FP8 format weight updates come in (rollout.quantization fp8), each quantised
        weight with its scale; the engine samples with them dequantised, the values SGLang's FP8 weights hold."""
        self.model = model.eval()
        self.weight_format = weight_format
        self.image_processor = image_processor
        self.pad_token_id = pad_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_batch_size = max_batch_size
        # Generators live on the model's device: drawing the sampling noise on the host and copying it over would
        # cost a vocabulary-sized transfer per token (10x the step time of greedy decoding, measured on an H100).
        self.generator = torch.Generator(self.device).manual_seed(seed)
        # Only the last position's logits are sampled from: a prefill that asks for no others skips a [batch, prompt,
        # vocabulary] tensor (gigabytes for a 150k vocabulary and long prompts). Remote-code models may lack the option.
        self._last_logits_only = (
            {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {})
        # transformers 5.24 names the KV cache `cache`, argument and output field alike, and warns on every call made
        # with the old `past_key_values`; older versions know only that one.
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.weight_version: str | None = None
        # transformers 5's MoE families route with a *TopKRouter module per MoE layer, returning (logits, weights,
        # expert ids): what routing replay records (models/routing_replay.py).
        self.routers = [module for module in model.modules() if type(module).__name__.lower().endswith("topkrouter")]
        self.draft = MTPDraft(model) if num_draft_tokens else None
        self.speculative = SpeculativeDecoder(self.draft, num_draft_tokens) if num_draft_tokens else None
        self._released: set[str] = set()
        self._offloaded: dict[str, torch.Tensor] = {}
        self._alive = True

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, requests: Sequence[GenerationRequest], progress: Progress = None,
                 interrupted: Callable[[], bool] | None = None) -> list[GenerationResult]:
        """`interrupted`, asked between tokens: once it says true, every unfinished sample returns what it has so
        far with finish reason `abort` (SGLang's abort on pause_generation, which partial rollout continues)."""
        self._check_usable()
        # Asked once: `self.device` walks the model's modules, and asking it per sample was a twentieth of a batch's
        # time (benchmarks/RESULTS.md, "Measured reasons in the code").
        device = self.device
        if self.generator.device != device:  # the model moved after construction: its stream goes with it
            seed = int(torch.randint(2**62, (), generator=self.generator, device=self.generator.device))
            self.generator = torch.Generator(device).manual_seed(seed)
        samples = [
            RequestSample(
                request_index,
                sample_index,
                request.prompt_token_ids,
                request.sampling,
                # Seed per sample, so sample i of a seeded request is the same whatever else is in the batch.
                None
                if request.sampling.seed is None
                else torch.Generator(device).manual_seed(
                    (request.sampling.seed * 1_000_003 + sample_index) % 2**63),
                request.images if request.images is not None and request.images.data else None,
            )
            for request_index, request in enumerate(requests)
            for sample_index in range(request.sampling.n)
        ]
        routing = any(request.return_routed_experts for request in requests)
        if routing and not self.routers:
            raise ValueError("routed experts were asked for, and the rollout model has no top-k routers "
                             f"({type(self.model).__name__})")
        if self.speculative is not None and (routing or any(s.images is not None for s in samples)):
            raise ValueError("speculative decoding in the local engine records no routed experts and takes no images")
        results: list[GenerationResult] = []
        for start in range(0, len(samples), self.max_batch_size):
            batch = samples[start : start + self.max_batch_size]
            if self.speculative is not None:
                generated = self.speculative.generate_batch(self, batch, interrupted)
            else:
                with _RouterRecorder(self.routers) if routing else contextlib.nullcontext() as recorder:
                    generated = self._generate_batch(batch, interrupted, recorder)
            results.extend(generated)
            report(progress, len(batch))
        return results

    # Inference mode, not just no_grad: no version counters or views tracked on the KV cache and activations, a
    # measurable part of a decode step (benchmarks/RESULTS.md, "Measured reasons in the code"); nothing made here reaches autograd.
    @torch.inference_mode()
    def _generate_batch(self, samples: list[RequestSample], interrupted: Callable[[], bool] | None = None,
                        recorder: "_RouterRecorder | None" = None) -> list[GenerationResult]:
        device = self.device
        batch = len(samples)
        prompts = prompt_batch(samples, self.pad_token_id, device)
        prompt_of, padding, input_ids, attention_mask = (prompts.prompt_of, prompts.padding, prompts.input_ids,
                                                         prompts.attention_mask)
        images = self._prefill_images(prompts.images, input_ids, attention_mask)
        position_ids = images.pop("position_ids", prompts.position_ids)

        temperatures = torch.tensor([s.sampling.temperature for s in samples], device=device)
        greedy = temperatures == 0
        is_greedy = greedy.tolist()
        # Greedy rows report log-probs at temperature 1.
        divisors = torch.where(greedy, torch.ones_like(temperatures), temperatures).unsqueeze(-1)

        outputs: list[list[int]] = [[] for _ in samples]
        logprobs: list[list[float]] = [[] for _ in samples]
        finish: list[FinishReason | None] = [None] * batch
        cache = None
        noise = None
        for position in range(max(s.sampling.max_new_tokens for s in samples)):
            if interrupted is not None and interrupted():
                finish = [reason or "abort" for reason in finish]
                break
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{self.cache_argument: cache},
                **self._last_logits_only,
                **images,
            )
            images = {}  # the prefill put the images' embeddings in the KV cache
            cache, logits = getattr(out, self.cache_argument), out.logits[:, -1, :]
            if position == 0 and prompts.distinct < batch:  # from one row per prompt to one per sample
                cache.reorder_cache(prompt_of)
                logits, attention_mask = logits[prompt_of], attention_mask[prompt_of]
                position_ids = position_ids.index_select(-2, prompt_of)  # [rows, L] or M-RoPE's [3, rows, L]
            raise_if_not_finite(logits, position, finish)
            scaled = logits.float() / divisors
            token_logprobs = torch.log_softmax(scaled, dim=-1)
            sampled = [row for row in range(batch) if finish[row] is None and not is_greedy[row]]
            if sampled and noise is None:
                noise = _Noise(samples, scaled.shape[-1], self.generator)
            if len(sampled) == batch:  # GRPO's rollouts until a sample ends: no gather and scatter of the rows
                next_tokens = self._sample(scaled, samples, noise(position, sampled))
            else:
                next_tokens = torch.argmax(scaled, dim=-1)
                if sampled:
                    next_tokens[sampled] = self._sample(scaled[sampled], [samples[row] for row in sampled],
                                                        noise(position, sampled))
            chosen = token_logprobs.gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1).tolist()
            for row, (token, sample) in enumerate(zip(next_tokens.tolist(), samples)):
                if finish[row] is not None:
                    continue
                outputs[row].append(token)
                logprobs[row].append(chosen[row])
                if token in sample.sampling.stop_token_ids or token in self.eos_token_ids:
                    finish[row] = "stop"
                elif len(outputs[row]) >= sample.sampling.max_new_tokens:
                    finish[row] = "length"
            if all(reason is not None for reason in finish):
                break
            input_ids = next_tokens.unsqueeze(-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=-1)
            # A prompt ends with text, whose M-RoPE position is the largest so far on all three axes: a generated
            # token's is one past it, as transformers' rope deltas give.
            position_ids = position_ids[..., -1:] + 1
        routed = [None] * batch if recorder is None else recorder.per_sample(prompt_of.tolist(), padding,
                                                                             [len(o) for o in outputs])
        return [
            GenerationResult(
                request_index=sample.request_index,
                sample_index=sample.sample_index,
                output_token_ids=tuple(outputs[row]),
                output_token_logprobs=tuple(logprobs[row]),
                finish_reason=finish[row] or "length",
                weight_version=self.weight_version,
                routed_experts=routed[row],
            )
            for row, sample in enumerate(samples)
        ]

    def _prefill_images(self, prompt_images: list, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        """The prefill's vision inputs: every prompt's images through the image processor, in prompt order, and
        the prompts' M-RoPE positions [3, prompts, L] (models.mrope, which the actor's batches use too); nothing when
        no prompt has images."""
        if all(images is None for images in prompt_images):
            return {}
        if self.image_processor is None:
            raise ValueError("a request has images and the rollout model has no image processor "
                             "(preprocessor_config.json beside its config.json)")
        pixels, grids = zip(*(pixel_values(self.image_processor, images, _ANY_SIZE)
                              for images in prompt_images if images is not None))
        grid_thw = torch.cat(grids).to(input_ids.device)
        config = self.model.config
        positions = mrope_position_ids(input_ids, grid_thw, config.image_token_id,
                                       config.vision_config.spatial_merge_size, attention_mask)
        return dict(pixel_values=torch.cat(pixels).to(self.device), image_grid_thw=grid_thw, position_ids=positions)

    @staticmethod
    def _sample(scaled: torch.Tensor, samples: list[RequestSample], uniform: torch.Tensor) -> torch.Tensor:
        """One token per row of `scaled` (logits / temperature) by the Gumbel-max trick: argmax of the filtered logits
        plus Gumbel noise (from `uniform`, _Noise's) is a draw from their softmax. The filtering and the draw run on
        the whole batch at once."""
        filtered = filter_for_samples(scaled, samples)
        # In float64, -log(-log(u)) keeps its accuracy for u near 1 (the noise's upper tail); a u of exactly 0 gives
        # -inf, never drawn.
        gumbel = -torch.log(-torch.log(uniform))
        return torch.argmax(filtered + gumbel.to(scaled.dtype), dim=-1)

    @torch.no_grad()
    def update_weights(self, named_tensors: WeightStream, version: str) -> None:
        """Copy HF checkpoint-named tensors into the model in place; an unknown name or shape is an error."""
        self._check_usable()
        targets = checkpoint_named_weights(self.model, self.draft)  # per call: release/resume may move the storage
        halves: dict[str, torch.Tensor] = {}  # FP8 weights and scales whose partner has not arrived yet
        for item in named_tensors:
            pairs = item.named_tensors() if isinstance(item, FlattenedBucket) else [item]
            destinations, sources = [], []
            for name, tensor in pairs:
                if self.weight_format is not None and (tensor.dtype == FP8 or name.endswith(SCALE_SUFFIX)):
                    name, tensor = self._dequantised(name, tensor, halves)
                    if tensor is None:
                        continue
                target = targets.get(name)
                if target is None and self._unused_mtp_weight(name):
                    continue
                if target is None:
                    raise KeyError(f"weight the model does not have: {name}")
                if target.shape != tensor.shape:
                    raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, the model has {tuple(target.shape)}")
                destinations.append(target)
                sources.append(tensor)
            # A bucket's tensors in one multi-tensor copy: one copy_ per tensor costs a launch each, several times
            # the bytes' own time on a GPU (benchmarks/RESULTS.md, "Measured reasons in the code").
            if destinations:
                torch._foreach_copy_(destinations, sources)
        if halves:
            raise ValueError(f"FP8 weight update without the partner of {sorted(halves)[:5]}: each quantised weight "
                             f"comes with its {SCALE_SUFFIX}")
        self.weight_version = version

    def _unused_mtp_weight(self, name: str) -> bool:
        """A weight of an MTP layer the engine does not draft with (all of them without speculative decoding, those
        after the first with it), which a whole checkpoint's stream holds (a custom weight loader's, a test's; the
        sync sends none): skipped, as SGLang's model skips them without NEXTN and its NEXTN draft loads only the
        first."""
        config = self.model.config
        layer, mtp_layers = _LAYER_INDEX.match(name), getattr(config, "num_nextn_predict_layers", 0)
        if layer is None or not mtp_layers:
            return False
        first, end = config.num_hidden_layers + (self.draft is not None), config.num_hidden_layers + mtp_layers
        return first <= int(layer[1]) < end

    def weight_digests(self, names: Sequence[str]) -> dict[str, str]:
        """The checksum of each weight of `names` the model holds (trainer.check_sync_every); a name it does not
        hold is left out."""
        targets = checkpoint_named_weights(self.model, self.draft)
        return {name: digest(targets[name]) for name in names if name in targets}

    def _dequantised(self, name: str, tensor: torch.Tensor, halves: dict[str, torch.Tensor]
                     ) -> tuple[str, torch.Tensor | None]:
        """(weight name, dequantised weight) once both halves of a quantised weight arrived, else (name, None)."""
        weight_name = name.removesuffix(SCALE_SUFFIX)
        partner = weight_name if name.endswith(SCALE_SUFFIX) else weight_name + SCALE_SUFFIX
        if partner not in halves:
            halves[name] = tensor.clone()  # a bucket's buffer is refilled before the next bucket arrives
            return name, None
        other = halves.pop(partner)
        weight, scale = (other, tensor) if name.endswith(SCALE_SUFFIX) else (tensor, other)
        return weight_name, self.weight_format.dequantise(weight, scale)

    def _unique_state(self) -> dict[str, torch.Tensor]:
        """The state dict with each tensor once: tied embeddings appear under two names, and moving the second would
        record the first's host copy as its device original (resume then left the tied weight on the host)."""
        unique: dict[int, tuple[str, torch.Tensor]] = {}
        draft = () if self.draft is None else self.draft.state_dict(prefix="mtp_draft.", keep_vars=True).items()
        for name, tensor in [*self.model.state_dict(keep_vars=True).items(), *draft]:
            unique.setdefault(id(tensor), (name, tensor))
        return dict(unique.values())

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Moves the weights to CPU on an accelerator (the KV cache only lives during `generate`)."""
        tags = check_memory_tags(tags)
        if "weights" in tags and "weights" not in self._released and self.device.type != "cpu":
            for name, tensor in self._unique_state().items():
                self._offloaded[name] = tensor.data
                tensor.data = tensor.data.to("cpu", non_blocking=True)
        self._released.update(tags)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        tags = check_memory_tags(tags)
        if "weights" in tags and self._offloaded:
            state = self._unique_state()
            for name, original in self._offloaded.items():
                original.copy_(state[name].data)
                state[name].data = original
            self._offloaded.clear()
        self._released.difference_update(tags)

    def health(self) -> bool:
        return self._alive

    def shutdown(self) -> None:
        self._alive = False
        self.model = None  # type: ignore[assignment]

    def _check_usable(self) -> None:
        if not self._alive:
            raise RuntimeError("the engine was shut down")
        if "weights" in self._released:
            raise RuntimeError("weights are released; call resume_memory(['weights']) first")
