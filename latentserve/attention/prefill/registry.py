"""The prefill backend registry: built-ins by class path, a CUSTOM slot, run-time registration."""
from __future__ import annotations

from latentserve.attention.backend_registry import BackendEnum, make_register_function


class MLAPrefillBackendEnum(BackendEnum):
    NATIVE = "latentserve.attention.prefill.native.NativePrefillBackend"
    TORCH_SDPA = "latentserve.attention.prefill.torch_sdpa.TorchSDPAPrefillBackend"
    REFERENCE = "latentserve.attention.prefill.reference.ReferencePrefillBackend"
    CUSTOM = ""


register_mla_prefill_backend = make_register_function(MLAPrefillBackendEnum)
