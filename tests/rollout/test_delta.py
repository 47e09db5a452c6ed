"""Delta weight sync's records (rlmegatron/rollout/delta.py): exact after every push for every dtype and encoding,
the same whatever the bucket size, partners loaded together, the bytes each encoding costs, and the engine side's
checksums against a full push's."""
import math

import pytest
import torch

from rlmegatron.models.fp8 import DEFAULT as FP8_FORMAT, SCALE_SUFFIX
from rlmegatron.rollout.buckets import Bucketer, TravelRule
from rlmegatron.rollout.delta import (DeltaReceiver, DeltaSender, SyncBytes, bits, encode, expected_digests,
                                      iter_records, load_groups, pack_mask, unpack_mask)


def _step(tensor: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    """`tensor` after an update of relative size `scale`, rounded to its dtype (what training does to it)."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(tensor.shape, generator=generator) * scale
    return (tensor.float() * (1 + noise)).to(tensor.dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("encoding", ["auto", "indices", "bitmask"])
def test_every_push_leaves_the_engine_bit_for_bit_where_a_full_push_would(dtype, encoding):
    torch.manual_seed(0)
    weights = {"a.weight": torch.randn(37, 29).to(dtype), "b.bias": torch.randn(101).to(dtype)}
    # NaN, both zeros and an infinity survive as bits (float8_e4m3fn has no infinity; its NaN is 0x7f).
    special = torch.tensor([math.nan, -0.0, 0.0, math.inf if dtype != torch.float8_e4m3fn else 1.0])
    weights["b.bias"][:4] = special.to(dtype)
    sender, receiver = DeltaSender(encoding=encoding), DeltaReceiver()
    receiver.apply(sender.records(list(weights.items()), full=True)[0])
    for step in range(4):
        weights = {name: _step(tensor, 10 ** -(step + 1), step) for name, tensor in weights.items()}
        if step == 2:
            weights["b.bias"][5:7] = torch.tensor([-0.0, math.nan]).to(dtype)  # 0.0 -> -0.0 is a change of bits
        records, counted = sender.records(list(weights.items()), full=False)
        loaded = dict(receiver.apply(records))
        for name, tensor in weights.items():
            assert _same_bits(receiver.held[name], tensor), (name, step)
        assert set(loaded) <= set(weights) and counted.full == sum(t.numel() * t.element_size()
                                                                   for t in weights.values())
    if encoding != "auto":  # forced: every changed tensor in that encoding
        assert all(name.endswith(("#idx", "#val")) if encoding == "indices" else name.endswith(("#mask", "#val"))
                   for name, _ in records if "#" in name)


def test_each_encoding_costs_what_it_says_and_auto_takes_the_smallest():
    old = torch.zeros(1000, dtype=torch.bfloat16)
    few, many = old.clone(), old.clone()
    few[[3, 500]] = 1.0  # 2 changes: indices 2 x (4 + 2) = 12 bytes; bitmask 125 + 4 = 129
    many[::4] = 1.0  # 250 changes: indices 1500; bitmask 125 + 500 = 625; whole 2000
    sizes = {enc: sum(t.numel() * t.element_size() for _, t in encode("w", few, old, enc)) for enc in ("indices",
                                                                                                        "bitmask")}
    assert sizes == {"indices": 12, "bitmask": 129}
    assert [name for name, _ in encode("w", few, old)] == ["w#idx", "w#val"]
    assert [name for name, _ in encode("w", many, old)] == ["w#mask", "w#val"]
    everything = old + 1
    assert [name for name, _ in encode("w", everything, old)] == ["w"]  # no delta beats the whole tensor
    assert encode("w", old.clone(), old) == []


def test_the_bitmask_packs_eight_positions_a_byte_little_endian():
    mask = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert pack_mask(mask).tolist() == [0b10000001, 0b1]
    assert torch.equal(unpack_mask(pack_mask(mask), 9), mask)


def test_bucket_boundaries_change_the_requests_not_what_the_engine_holds():
    torch.manual_seed(1)
    weights = [(f"layers.{i}.w", torch.randn(16, 8).bfloat16()) for i in range(6)]
    held = []
    for bucket_bytes in (256, 700, 1 << 20):
        sender, receiver = DeltaSender(), DeltaReceiver()
        for step, full in enumerate([True, False, False]):
            now = [(name, _step(tensor, 1e-2, step)) if step else (name, tensor) for name, tensor in weights]
            buckets = Bucketer(bucket_bytes).buckets(iter(now))
            for records in iter_records(buckets, sender, full, SyncBytes()):
                receiver.apply(records)
        held.append({name: bits(tensor).clone() for name, tensor in receiver.held.items()})
    assert all(h.keys() == held[0].keys() and all(torch.equal(h[n], held[0][n]) for n in h) for h in held)


def test_a_changed_tensor_comes_with_the_partners_it_must_be_loaded_with():
    rule = TravelRule(__import__("re").compile(r"experts\.(?P<member>gate|up)\.weight"), frozenset({"gate", "up"}))
    groups = load_groups([rule], SCALE_SUFFIX)
    old = {"experts.gate.weight": torch.ones(4), "experts.up.weight": torch.ones(4),
           "o.weight": torch.ones(4).to(torch.float8_e4m3fn), "o.weight" + SCALE_SUFFIX: torch.ones(1),
           "alone.weight": torch.ones(4)}
    sender, receiver = DeltaSender(groups), DeltaReceiver()
    receiver.apply(sender.records(list(old.items()), full=True)[0])
    new = dict(old)
    new["experts.gate.weight"] = torch.full((4,), 2.0)
    new["o.weight"] = torch.full((4,), 2.0).to(torch.float8_e4m3fn)
    records, counted = sender.records(list(new.items()), full=False)
    loaded = [name for name, _ in receiver.apply(records)]
    assert loaded == ["experts.gate.weight", "experts.up.weight", "o.weight", "o.weight" + SCALE_SUFFIX]
    assert counted.tensors_changed == 2 and counted.tensors == 5
    # An FP8 record travels as its bytes under a name that says its dtype (SGLang's safe unpickler cannot rebuild an
    # FP8 storage), and comes back as FP8.
    fp8_records = [(name, tensor.dtype) for name, tensor in records if name.startswith("o.weight")
                   and not name.endswith(SCALE_SUFFIX + "#same")]
    assert fp8_records and all(name.endswith("@float8_e4m3fn") and dtype == torch.uint8
                               for name, dtype in fp8_records if "#idx" not in name and "#mask" not in name)
    assert receiver.held["o.weight"].dtype == torch.float8_e4m3fn


def test_a_delta_to_an_engine_that_never_got_the_tensor_whole_is_refused():
    sender = DeltaSender()
    sender.records([("w", torch.zeros(8))], full=True)
    records, _ = sender.records([("w", torch.ones(8) * (torch.arange(8) == 3))], full=False)
    with pytest.raises(KeyError, match="a delta for w, which this engine has not received whole yet"):
        DeltaReceiver().apply(records)


def test_the_engines_checksums_match_a_full_push_and_name_the_tensor_that_differs():
    from transformers import AutoConfig

    from rlmegatron.rollout.local import LocalEngine, causal_lm_from_config

    config = AutoConfig.from_pretrained("configs/quickstart/model")
    torch.manual_seed(2)
    source = causal_lm_from_config(config, torch.float32, False)
    stream = [(name, tensor.detach().clone()) for name, tensor in source.state_dict().items()
              if name != "lm_head.weight" or not config.tie_word_embeddings]
    for weight_format in (None, FP8_FORMAT):
        engine = LocalEngine(causal_lm_from_config(config, torch.bfloat16, False), weight_format=weight_format)
        pushed = stream if weight_format is None else list(weight_format.quantised_stream(iter(stream)))
        engine.update_weights(iter(pushed), "v1")
        expected = expected_digests(iter(pushed), weight_format, torch.bfloat16)
        assert engine.weight_digests(sorted(expected)) == expected
        name = "model.layers.0.mlp.down_proj.weight"
        with torch.no_grad():
            dict(engine.model.named_parameters())[name].view(-1)[7] += 1
        held = engine.weight_digests(sorted(expected))
        assert [n for n in expected if held[n] != expected[n]] == [name]
