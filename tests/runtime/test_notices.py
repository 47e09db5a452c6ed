"""The ranks silence the library notices rlmegatron/runtime/notices.py names, by their text and category, and no
other warning."""
import warnings

import torch

from rlmegatron.runtime.notices import quiet_library_notices

NOTICES = [
    (UserWarning, "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."),
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                    "`torch.distributed.reduce_scatter_single` instead."),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                    "`torch.distributed.all_gather_single` instead."),
    (FutureWarning, "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` "
                    "instead."),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
]
OTHERS = [(UserWarning, "something the user should see"),
          (DeprecationWarning, "Transformer Engine and Apex are not installed")]  # another category


def shown(device: str, raise_them) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_library_notices(device)
        raise_them()
    return [str(w.message) for w in caught]


def warn_all(pairs):
    def raise_them():
        for category, message in pairs:
            warnings.warn(message, category)
    return raise_them


def test_the_named_notices_are_silenced_and_nothing_else():
    assert shown("cpu", warn_all(NOTICES + OTHERS)) == [message for _, message in OTHERS]


def test_on_gpus_missing_transformer_engine_and_apex_are_still_reported():
    assert shown("cuda", warn_all(NOTICES[:2])) == [message for _, message in NOTICES[:2]]


def test_torch_own_non_leaf_grad_warning_is_matched():
    leaf = torch.ones(2, requires_grad=True)

    def read_grad_of_a_view():
        assert (leaf * 2).grad is None

    with warnings.catch_warnings(record=True) as unfiltered:
        warnings.simplefilter("always")
        read_grad_of_a_view()
    assert any("not a leaf Tensor" in str(w.message) for w in unfiltered)  # torch does warn here
    assert shown("cpu", read_grad_of_a_view) == []
