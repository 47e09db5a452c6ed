"""The CPU layer's CUDA-literal rewrite: on in a CPU rank, off inside plain_torch (the local engine's generation)."""
from rlmegatron.transport.local_ranks import run_ranks


def _cuda_literals_in_and_out_of_plain_torch() -> dict:
    import torch

    from rlmegatron.runtime.cpu_compat import plain_torch

    def zeros_on_cuda():
        try:
            return str(torch.zeros(2, device="cuda").device)
        except (AssertionError, RuntimeError) as error:  # a CPU build of torch has no CUDA
            return type(error).__name__

    report = {"rank": zeros_on_cuda()}
    with plain_torch():
        report["plain"] = zeros_on_cuda()
    report["after"] = zeros_on_cuda()
    return report


def test_plain_torch_turns_the_cuda_literal_rewrite_off_and_back_on():
    report = run_ranks(_cuda_literals_in_and_out_of_plain_torch, 1, timeout_s=120)[0]
    assert report == {"rank": "cpu", "plain": "AssertionError", "after": "cpu"}
