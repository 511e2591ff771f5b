"""The seed's regression: each metadata builder owns a clone of the prefill backend."""
import pytest
import torch

from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.prefill.base import MLAPrefillBackend, OwnershipError
from latentserve.attention.prefill.reference import ReferencePrefillBackend
from latentserve.config import AttentionConfig
from tests.attention.mla_case import MLA, Request, make_batch, setup


class ExtraArgsBackend(ReferencePrefillBackend):
    def __init__(self, *args, tile: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.tile = tile


def _backend(cls=ReferencePrefillBackend, **extra):
    return cls(4, 0.5, 8, 16, 8, 32, AttentionConfig(), **extra)


def test_clone_is_independent_instance_with_same_settings():
    backend = _backend()
    clone = backend.clone()
    assert type(clone) is type(backend) and clone is not backend
    for attr in ("num_heads", "scale", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "config"):
        assert getattr(clone, attr) == getattr(backend, attr)
    # Preparing one leaves the other as it was: no per-batch state is shared (on the instance or the class).
    first, second = object(), object()
    backend.prepare_metadata(first)
    assert clone._prefill_metadata is None
    clone.prepare_metadata(second)
    assert backend.prefill_metadata is first and clone.prefill_metadata is second


def test_clone_of_subclass_with_extra_constructor_arguments():
    backend = _backend(ExtraArgsBackend, tile=64)
    clone = backend.clone()
    assert isinstance(clone, ExtraArgsBackend) and clone.tile == 64 and clone is not backend


def test_clone_does_not_copy_prepared_state_or_owner():
    config = AttentionConfig(block_size=4)
    layer, builder, cache = setup(config, 16)
    builder.build(make_batch([Request(0, 5)], cache, 4).common)
    clone = builder.prefill_backends[layer.layer_name].clone()
    assert clone._prefill_metadata is None and clone._owner is None


def test_each_builder_owns_its_own_backend():
    config = AttentionConfig(block_size=4)
    layer, builder0, _ = setup(config, 16)
    builder1 = MLAMetadataBuilder([layer.layer_name], {layer.layer_name: layer}, config, builder_id=1)
    name = layer.layer_name
    backends = {id(layer.prefill_backend), id(builder0.prefill_backends[name]), id(builder1.prefill_backends[name])}
    assert len(backends) == 3


def test_second_owner_is_refused_in_debug_mode(monkeypatch):
    """Take clone() away: the second builder would share the layer's instance, and the guard fires."""
    monkeypatch.setattr(MLAPrefillBackend, "clone", lambda self: self)
    config = AttentionConfig(block_size=4)
    layer, _, _ = setup(config, 16)
    with pytest.raises(OwnershipError, match="already owned"):
        MLAMetadataBuilder([layer.layer_name], {layer.layer_name: layer}, config, builder_id=1)


def test_forward_with_metadata_prepared_for_another_batch_raises():
    config = AttentionConfig(block_size=4)
    layer, builder, cache = setup(config, 32)
    first = builder.build(make_batch([Request(0, 5)], cache, 4, seed=1).common)
    builder.build(make_batch([Request(0, 3), Request(0, 2)], cache, 4, seed=2).common)
    with pytest.raises(OwnershipError, match="prepared for another batch"):
        first.prefill.backends[layer.layer_name].check_prepared_for(first.prefill)
    assert torch.is_tensor(first.slot_mapping)
