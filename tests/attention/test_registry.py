"""Registry and selector behaviour of prefill (and decode) backends."""
import pytest
import torch

from latentserve.attention.backend import SelectorConfig
from latentserve.attention.decode.registry import MLADecodeBackendEnum, register_mla_decode_backend
from latentserve.attention.decode.selector import get_mla_decode_backend
from latentserve.attention.prefill.reference import ReferencePrefillBackend
from latentserve.attention.prefill.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
from latentserve.attention.prefill.selector import get_mla_prefill_backend
from latentserve.attention.prefill.torch_sdpa import TorchSDPAPrefillBackend

CFG = SelectorConfig(torch.float32, 4, 32, 16, 8, 12)


class CustomPrefill(ReferencePrefillBackend):
    @classmethod
    def get_name(cls):
        return "CUSTOM_TEST"


class CudaOnlyPrefill(ReferencePrefillBackend):
    supported_device_types = ("cuda",)
    supported_dtypes = (torch.bfloat16,)

    @classmethod
    def get_name(cls):
        return "CUDA_ONLY"


PATH = f"{__name__}.CustomPrefill"
CUDA_PATH = f"{__name__}.CudaOnlyPrefill"
DECODE_PATH = "latentserve.attention.decode.reference.ReferenceDecodeBackend"


@pytest.fixture(autouse=True)
def _clean_overrides():
    yield
    for enum_cls in (MLAPrefillBackendEnum, MLADecodeBackendEnum):
        for member in enum_cls:
            member.clear_override()


def test_builtins_resolve_to_classes():
    assert MLAPrefillBackendEnum.TORCH_SDPA.get_class() is TorchSDPAPrefillBackend
    assert MLAPrefillBackendEnum.REFERENCE.get_class() is ReferencePrefillBackend
    assert MLAPrefillBackendEnum.TORCH_SDPA.get_class().get_name() == "TORCH_SDPA"


def test_custom_must_be_registered_before_use():
    with pytest.raises(ValueError, match="must be registered before use"):
        MLAPrefillBackendEnum.CUSTOM.get_path()
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, PATH)
    assert MLAPrefillBackendEnum.CUSTOM.is_overridden()
    assert MLAPrefillBackendEnum.CUSTOM.get_class() is CustomPrefill
    MLAPrefillBackendEnum.CUSTOM.clear_override()
    assert not MLAPrefillBackendEnum.CUSTOM.is_overridden()
    with pytest.raises(ValueError, match="must be registered before use"):
        MLAPrefillBackendEnum.CUSTOM.get_class()


def test_override_builtin_and_clear():
    register_mla_prefill_backend("torch_sdpa", PATH)
    assert MLAPrefillBackendEnum.TORCH_SDPA.get_class() is CustomPrefill
    MLAPrefillBackendEnum.TORCH_SDPA.clear_override()
    assert MLAPrefillBackendEnum.TORCH_SDPA.get_class() is TorchSDPAPrefillBackend


@pytest.mark.parametrize(
    "enum_cls,register,path",
    [
        (MLAPrefillBackendEnum, register_mla_prefill_backend, PATH),
        (MLADecodeBackendEnum, register_mla_decode_backend, DECODE_PATH),
    ],
)
def test_new_name_becomes_an_overridden_member(enum_cls, register, path):
    """vLLM's semantics: a new string name makes a member and marks it overridden, in both forms."""
    prefix = enum_cls.__name__[:6].upper()
    register(f"{prefix}_DIRECT", path)
    direct = enum_cls[f"{prefix}_DIRECT"]
    assert direct in list(enum_cls) and direct.is_overridden() and direct.get_path() == path
    direct.clear_override()
    assert not direct.is_overridden() and direct.get_path() == path  # the member's own value remains

    assert register(f"{prefix}_DECORATED")(CustomPrefill) is CustomPrefill  # the decorator form
    decorated = enum_cls[f"{prefix}_DECORATED"]
    assert decorated.is_overridden() and decorated.get_class() is CustomPrefill
    assert enum_cls.lookup(f"{prefix.lower()}_decorated") is decorated
    decorated.clear_override()
    with pytest.raises(ValueError, match="must be registered before use"):
        decorated.get_class()


def test_plugin_style_names_and_decorator_with_a_path():
    """What vLLM accepts is accepted: any identifier as a name, and the direct form used as a decorator."""
    register_mla_prefill_backend("my_plugin_prefill", PATH)
    assert MLAPrefillBackendEnum["my_plugin_prefill"].get_class() is CustomPrefill
    assert MLAPrefillBackendEnum.lookup("my_plugin_prefill") is MLAPrefillBackendEnum.my_plugin_prefill

    @register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, PATH)
    class Unchanged:
        pass

    assert isinstance(Unchanged, type) and Unchanged.__name__ == "Unchanged"
    assert MLAPrefillBackendEnum.CUSTOM.get_class() is CustomPrefill


def test_register_rejects_duplicates_and_bad_names():
    MLAPrefillBackendEnum.register("RUNTIME_ONE", PATH)
    assert MLAPrefillBackendEnum.RUNTIME_ONE.get_class() is CustomPrefill
    assert not MLAPrefillBackendEnum.RUNTIME_ONE.is_overridden()
    with pytest.raises(ValueError, match="already exists"):
        MLAPrefillBackendEnum.register("RUNTIME_ONE", PATH)
    for bad in ["", "1ABC", "HAS-DASH", None, "_private"]:
        with pytest.raises(ValueError, match="invalid backend name"):
            MLAPrefillBackendEnum.register(bad, PATH)
    with pytest.raises(ValueError, match="reserved"):
        MLAPrefillBackendEnum.register("lookup", PATH)


@pytest.mark.parametrize("enum_cls", [MLAPrefillBackendEnum, MLADecodeBackendEnum])
def test_unknown_name_lists_valid_ones(enum_cls):
    first = next(iter(enum_cls)).name
    with pytest.raises(ValueError, match=rf"unknown {enum_cls.__name__} name 'NONEXISTENT'.*{first}.*CUSTOM"):
        enum_cls["NONEXISTENT"]
    with pytest.raises(ValueError, match=rf"unknown {enum_cls.__name__} name 'NOPE'.*{first}.*CUSTOM"):
        enum_cls.lookup("nope")


def test_selector_picks_first_valid_by_priority():
    register_mla_prefill_backend(MLAPrefillBackendEnum.NATIVE, CUDA_PATH)  # as where the kernels do not run
    assert get_mla_prefill_backend("cpu", CFG) is TorchSDPAPrefillBackend
    register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, CUDA_PATH)
    # TORCH_SDPA now points at a CUDA/bf16-only class: the selector falls through to REFERENCE.
    assert get_mla_prefill_backend("cpu", CFG) is ReferencePrefillBackend


def test_explicit_choice_refused_with_every_reason():
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, CUDA_PATH)
    with pytest.raises(ValueError) as e:
        get_mla_prefill_backend("cpu", CFG, "custom")
    assert "device 'cpu'" in str(e.value) and "dtype torch.float32" in str(e.value)
    assert get_mla_prefill_backend("cpu", CFG, "REFERENCE") is ReferencePrefillBackend


def test_validate_configuration_lists_reasons():
    assert TorchSDPAPrefillBackend.validate_configuration("cpu", CFG) == []
    assert TorchSDPAPrefillBackend.supports_dtype(torch.bfloat16)
    assert len(CudaOnlyPrefill.validate_configuration("cpu", CFG)) == 2


def test_native_decode_takes_no_cache_rows_wider_than_its_kernel():
    """Cache rows past the kernel's LS_MAX_LATENT (latent + rope) go to PAGED, not to a kernel that refuses them."""
    from latentserve.attention.decode.native import NativeMQADecodeBackend
    from latentserve.kernels import native

    wide = SelectorConfig(torch.float32, 4, native.abi.MAX_LATENT - 63, 16, 64, 12)
    assert any("at most 2048 (latent + rope), not 2049" in r
               for r in NativeMQADecodeBackend.validate_configuration("cpu", wide))
    assert get_mla_decode_backend("cpu", wide).get_name() == "PAGED"


def test_decode_registry_and_selector():
    from latentserve.kernels.native import native_kernels
    from latentserve.kernels.cpu import cpu_features

    on_cpu = "NATIVE" if native_kernels(cpu_features())[0] is not None else "PAGED"
    assert get_mla_decode_backend("cpu", CFG).get_name() == on_cpu
    assert get_mla_decode_backend("cuda", CFG).get_name() == "TORCH"
    assert get_mla_decode_backend("cpu", CFG, "reference").get_name() == "REFERENCE"
    with pytest.raises(ValueError, match="must be registered before use"):
        MLADecodeBackendEnum.CUSTOM.get_class()
    register_mla_decode_backend(MLADecodeBackendEnum.CUSTOM, "latentserve.attention.decode.reference.ReferenceDecodeBackend")
    assert get_mla_decode_backend("cpu", CFG, MLADecodeBackendEnum.CUSTOM).get_name() == "REFERENCE"
    with pytest.raises(ValueError, match="valid names"):
        get_mla_decode_backend("cpu", CFG, "FLASHMLA_NOT_HERE")


def test_bad_class_path_is_a_clear_import_error():
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "no_such_module.Backend")
    with pytest.raises(ImportError, match="no_such_module.Backend"):
        MLAPrefillBackendEnum.CUSTOM.get_class()
