"""What the loopback SGLang stand-in unpickles a weight bucket with: no more than SGLang 0.5.23's `SafeUnpickler`
lets through (`sglang/srt/utils/common.py`, ALLOWED_GLOBALS), so a payload SGLang refuses is refused here too. The
globals are the subset a CPU weight bucket can name; tests/rollout/test_sglang_conformance.py checks that each of them
is in SGLang's own list. Its own module, outside the stand-in's `sglang` package, so the test imports it without it."""
import pickle

ALLOWED_GLOBALS = {
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "int"), ("builtins", "str"),
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "dtype"), ("torch", "device"), ("torch", "UntypedStorage"),
    *(("torch", name) for name in ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
                                   "uint8", "bool", "float8_e4m3fn")),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"Deserialization of {module}.{name} is not allowed")
        return super().find_class(module, name)
