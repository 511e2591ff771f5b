"""The decode backend registry, shaped like the prefill one."""
from __future__ import annotations

from latentserve.attention.backend_registry import BackendEnum, make_register_function


class MLADecodeBackendEnum(BackendEnum):
    NATIVE = "latentserve.attention.decode.native.NativeMQADecodeBackend"
    PAGED = "latentserve.attention.decode.paged.PagedMQADecodeBackend"
    TORCH = "latentserve.attention.decode.torch_mqa.TorchMQADecodeBackend"
    REFERENCE = "latentserve.attention.decode.reference.ReferenceDecodeBackend"
    CUSTOM = ""


register_mla_decode_backend = make_register_function(MLADecodeBackendEnum)
