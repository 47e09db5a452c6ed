"""Resumable batching: same seed same batches, epochs differ, and a restored state replays exactly."""
import pytest

from rlmegatron.data import PromptDataLoader, ResumableBatchSampler, Sample


def make_dataset(size):
    return [Sample(index=i, prompt=[], prompt_ids=[i], data_source="t", ground_truth=str(i)) for i in range(size)]


def test_each_epoch_covers_the_data_once_in_a_new_order():
    sampler = ResumableBatchSampler(10, 3, shuffle=True, seed=7)
    epoch0 = [sampler.next_batch() for _ in range(3)]  # 3 full batches, the 10th index dropped
    assert sampler.epoch_finished() and sampler.state.epoch == 0
    epoch1 = [sampler.next_batch() for _ in range(3)]
    assert sampler.state.epoch == 1
    assert len({i for b in epoch0 for i in b}) == 9
    assert epoch0 != epoch1
    assert ResumableBatchSampler(10, 3, seed=7).next_batch() == epoch0[0]  # seeded


def test_resuming_mid_epoch_yields_the_same_next_batches():
    uninterrupted = PromptDataLoader(make_dataset(11), 4, seed=3)
    resumed_from = PromptDataLoader(make_dataset(11), 4, seed=3)
    for _ in range(3):  # past the end of epoch 0 (2 batches) into epoch 1
        resumed_from.next_batch()
    state = resumed_from.state_dict()
    assert (state["epoch"], state["position"]) == (1, 1)

    for _ in range(3):
        uninterrupted.next_batch()
    restored = PromptDataLoader(make_dataset(11), 4, seed=3)
    restored.load_state_dict(state)
    for _ in range(5):
        assert [s.index for s in restored.next_batch()] == [s.index for s in uninterrupted.next_batch()]
    assert restored.epoch == uninterrupted.epoch == 3


def test_iter_epoch_gives_the_rest_of_the_epoch_then_a_fresh_one():
    loader = PromptDataLoader(make_dataset(8), 2, shuffle=False)
    loader.next_batch()
    assert [[s.index for s in b] for b in loader.iter_epoch()] == [[2, 3], [4, 5], [6, 7]]
    assert len(list(loader.iter_epoch())) == 4 and loader.epoch == 1


def test_a_state_from_a_different_shape_is_refused():
    state = PromptDataLoader(make_dataset(8), 2).state_dict()
    with pytest.raises(ValueError, match="checkpoint has batch_size=2, this run has 4"):
        PromptDataLoader(make_dataset(8), 4).load_state_dict(state)


def test_fewer_prompts_than_a_batch_is_an_error():
    with pytest.raises(ValueError, match="fewer than one batch"):
        ResumableBatchSampler(3, 4)
