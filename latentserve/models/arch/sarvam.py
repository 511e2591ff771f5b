"""Sarvam (sarvam_mla): DeepSeek-V3 under another model_type; its checkpoints have no q LoRA and route over all
experts in one group. transformers saves it as DeepseekV3ForCausalLM, the published configs as
SarvamMLAForCausalLM."""
from __future__ import annotations

from typing import Any

from latentserve.models.arch.base import Architecture


class SarvamMLA(Architecture):
    model_type = "sarvam_mla"
    architectures = ("SarvamMLAForCausalLM", "DeepseekV3ForCausalLM")
    summary = "Sarvam: DeepSeek-V3 without q LoRA"

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        # Its first configs call YaRN "deepseek_yarn" (transformers rewrites it the same way).
        scaling = raw.get("rope_scaling")
        if isinstance(scaling, dict) and "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
            scaling = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": "yarn"}
            return {**raw, "rope_scaling": scaling}
        return raw
