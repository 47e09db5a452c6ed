"""Opt-in CPU compatibility layer that lets Megatron-Core GPTModel (local spec) train on CPU under gloo.

Megatron-Core assumes CUDA in a few dozen places. Nothing here runs on import:
`enable_cpu_compat()` applies every patch once, and only the `device: cpu` path
calls it, so a GPU process that imports rlmegatron keeps stock Megatron-Core.
Each patch carries one comment saying which CUDA assumption it removes.

The modules the local layer spec uses instead of Megatron's, on CPU and GPU alike, are in
rlmegatron.models.layers.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False


class _CudaLiteralsToCpu(TorchFunctionMode):
    """Rewrites device="cuda" (or a CUDA ordinal) in torch calls to the CPU, and reports CPU tensors' types as CUDA ones."""

    @staticmethod
    def _to_cpu(device):
        if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
            return torch.device("cpu")
        if isinstance(device, torch.device) and device.type == "cuda":
            return torch.device("cpu")
        return device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = self._to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            # Pinned host memory needs a CUDA runtime (context parallelism's RoPE pins its chunk index).
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The distributed optimizer and grad clipping dispatch on CUDA type strings.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], self._to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def plain_torch():
    """Torch calls without the CUDA-literal rewrite, for code that names no CUDA device (transformers' generation in
    the local engine, this project's attention, RoPE, losses and weight export, torch's Adam): the rewrite runs Python
    for every torch call (benchmarks/RESULTS.md, "The CPU layer's rewrite in the training step"). Megatron-Core's
    own modules keep it: its MoE dispatch and context-parallel RoPE pin memory, its schedules name CUDA. A no-op
    where the layer is not enabled. Patching the factories themselves instead (torch.zeros = wrapper) is not an
    option: transformers' loading, which materialises buffers such as RoPE's inv_freq through them, then left
    those buffers uninitialised."""
    if not _ENABLED:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


class _NoStream:
    """Stand-in for torch.cuda.Stream/Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True


def _install_cpu_rng_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's named RNG streams (e.g. tensor-parallel init) on the CPU generator."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    # initialize_rng_tracker() looks this name up at call time.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)
    # Activation recompute saves and restores the CUDA generator beside the CPU one and the tracker's
    # streams; on CPU those two are the whole state, so the CUDA part is empty.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def _patch_alltoall_split_sizes():
    from megatron.core.tensor_parallel import mappings

    original_forward = mappings._AllToAll.forward

    def forward(ctx, group, input, output_split_sizes, input_split_sizes, *later_arguments):
        def as_list(sizes):
            return None if sizes is None else [int(s) for s in sizes]

        # *later_arguments: Megatron-Core 0.19 added use_nccl_stream (False on CPU), which 0.16 lacks.
        return original_forward(ctx, group, input, as_list(output_split_sizes), as_list(input_split_sizes),
                                *later_arguments)

    # The MoE alltoall dispatcher passes split sizes as tensors/arrays; gloo wants lists.
    mappings._AllToAll.forward = staticmethod(forward)


def _patch_uneven_gathers():
    from megatron.core.tensor_parallel import mappings

    original_gather = mappings._gather_along_first_dim
    original_reduce_scatter = mappings._reduce_scatter_along_first_dim

    def gather(input_, group, output_split_sizes=None, *later_arguments, **options):
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, *later_arguments, **options)
        sizes = [int(size) for size in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    def reduce_scatter(input_, group, input_split_sizes=None, *later_arguments, **options):
        if input_split_sizes is None or group.size() == 1:
            return original_reduce_scatter(input_, group, input_split_sizes, *later_arguments, **options)
        sizes = [int(size) for size in input_split_sizes]
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].clone()

    # The MoE alltoall dispatcher at expert TP > 1 gathers and reduce-scatters each rank's received tokens over the
    # expert-TP group, whose counts differ per rank. gloo's all_gather and reduce_scatter need equal sizes (NCCL's
    # do not): pad to the largest and slice, and reduce the whole then keep this rank's rows. The autograd functions
    # look both up by module name when they run.
    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


def _patch_shape_exchange():
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        def shape(tensor):
            return None if tensor is None else torch.tensor(tensor.size(), dtype=torch.int64)

        recv_prev_shape = torch.empty(3, dtype=torch.int64) if recv_prev else None
        recv_next_shape = torch.empty(3, dtype=torch.int64) if recv_next else None
        requests = p2p._p2p_ops(
            tensor_send_prev=shape(tensor_send_prev),
            tensor_recv_prev=recv_prev_shape,
            tensor_send_next=shape(tensor_send_next),
            tensor_recv_next=recv_next_shape,
            group=self.pp_group,
            prev_pipeline_rank=self.prev_rank,
            next_pipeline_rank=self.next_rank,
        )
        for direction, request in requests.items():
            if direction.startswith("recv"):
                request.wait()
            else:
                self._unfinished_shape_sends.append(request)  # holds the shape tensor until sent
        return tuple([0, 0, 0] if t is None else t.tolist() for t in (recv_prev_shape, recv_next_shape))

    original_communicate = p2p.P2PCommunicator._communicate

    def communicate(self, **kwargs):
        self._unfinished_shape_sends = []
        received = original_communicate(self, **kwargs)
        for request in self._unfinished_shape_sends:
            request.wait()
        return received

    # Variable-length micro-batches swap shapes with batch_isend_irecv regardless of batch_p2p_comm;
    # gloo pairs those by posting order, so at PP=2 under VPP the shapes cross and the ranks hang.
    # Megatron's unbatched p2p orders sends and receives by rank parity instead.
    p2p.P2PCommunicator._communicate_shapes = communicate_shapes
    # gloo's send wait() blocks the host until the peer posts the matching receive (NCCL's only orders
    # the stream), and Megatron waits on the shape sends before it posts the tensor exchange. When pipeline
    # rank 0 runs all its micro-batches in the interleaved warmup (PP2xVPP2 with 2 of them), its last
    # warmup step only sends an activation while rank 1's step also sends a gradient back: rank 1 waits
    # for rank 0 to take the gradient's shape, which rank 0 does in its next step, once its activation is
    # taken, which rank 1 does only after that shape wait. Waiting on shape sends after the tensor
    # exchange is posted breaks the cycle.
    p2p.P2PCommunicator._communicate = communicate


def enable_cpu_compat() -> None:
    """Apply every CPU patch (idempotent). Call before building any Megatron model."""
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("enable_cpu_compat() is for CPU-only runs; this process sees a CUDA device")

    # device="cuda" literals and .cuda() calls in Megatron-Core (optimizer, clip_grads, schedules, MoE).
    _CudaLiteralsToCpu().__enter__()
    # torch.cuda.current_device() feeds device= arguments; it raises on a CPU build.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.set_device = lambda *a, **k: None
    # Side streams (DDP overlap, MoE D2H, shared experts) are CUDA-only; CPU ops run in order.
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.record_stream = lambda self, *a, **k: None
    # Megatron's RNG tracker stores CUDA generator states.
    _install_cpu_rng_tracker()

    from megatron.core import jit
    from megatron.core.transformer.moe import moe_utils

    # jit_fuser is torch.compile, which would invoke the C++ toolchain on every new shape.
    jit.disable_jit_fuser()
    # Referenced by the router but undefined without Transformer Engine (0.16.1); None selects torch.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _patch_alltoall_split_sizes()
    _patch_uneven_gathers()
    _patch_shape_exchange()
    _ENABLED = True
