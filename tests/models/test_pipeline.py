"""The one pipeline split is Megatron-Core's own."""
import itertools

from rlmegatron.models.pipeline import PipelineSplitError, pipeline_stage_layers


def megatron_split(num_layers, pp, vpp, first, last):
    """[pipeline rank][virtual stage] -> layers, from Megatron's own offset and layer-count functions; None
    where Megatron rejects the split or builds a stage with a negative number of layers."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                                   pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                   virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=first,
                                   num_layers_in_last_pipeline_stage=last)
        split = []
        for rank in range(pp):
            stages = [None] if vpp is None else range(vpp)
            offsets = [(get_transformer_layer_offset(config, v, rank), get_num_layers_to_build(config, v, rank))
                       for v in stages]
            split.append([range(start, start + count) for start, count in offsets])
    except (ValueError, AssertionError):
        return None
    return None if any(len(chunk) != chunk.stop - chunk.start for stage in split for chunk in stage) else split


def test_the_split_is_megatrons_wherever_megatron_builds_one():
    agreed = 0
    for num_layers, pp, vpp, first, last in itertools.product(range(1, 10), (2, 3, 4), (None, 2), (None, 1, 2),
                                                                (None, 1, 3)):
        try:
            ours = pipeline_stage_layers(num_layers, pp, vpp, first, last)
        except PipelineSplitError:
            ours = None
        assert ours == megatron_split(num_layers, pp, vpp, first, last), (num_layers, pp, vpp, first, last)
        agreed += ours is not None
    assert agreed > 50  # the comparison covers real splits, not only rejections


def test_deepseek_v3_split_puts_one_layer_first_and_four_on_every_other_stage():
    split = pipeline_stage_layers(61, 16, first=1)
    assert [sum(len(chunk) for chunk in stage) for stage in split] == [1] + [4] * 15
    assert split == megatron_split(61, 16, None, 1, None)
