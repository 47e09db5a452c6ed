"""The stand-in model's routing (sglang_cpu_server), for a server launched with --enable-return-routed-experts: every
layer routed, each token to 2 distinct experts of 8 that follow from the token, the layer and the slot. Its own module:
the tests import it without SGLang."""

ROUTED_LAYERS, ROUTED_TOPK = 2, 2


def standin_expert(token: int, layer: int, slot: int) -> int:
    return (token * 7 + layer * 3 + slot) % 8
