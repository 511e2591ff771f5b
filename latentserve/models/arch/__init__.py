"""The architecture registry: config.json's `model_type` (or, lacking one, its `architectures`) -> the adapter of
that model family (`base.Architecture`). Adding an architecture: docs/adding_an_architecture.md."""
from __future__ import annotations

from latentserve.models.arch.axk1 import AXK1
from latentserve.models.arch.axk2 import AXK2
from latentserve.models.arch.bailing_hybrid import BailingHybrid
from latentserve.models.arch.base import Architecture
from latentserve.models.arch.deepseek import DeepseekV2, DeepseekV3, KimiK2
from latentserve.models.arch.deepseek_v32 import DeepseekV32, GlmMoeDsa
from latentserve.models.arch.dots3_note import Dots3Note
from latentserve.models.arch.glm4_moe_lite import Glm4MoeLite
from latentserve.models.arch.glm5_next import Glm5Next
from latentserve.models.arch.hy_v4 import HYV4, HYV4VL
from latentserve.models.arch.kimi_k25 import KimiK25
from latentserve.models.arch.kimi_linear import KimiLinear
from latentserve.models.arch.longcat_flash import LongcatFlash
from latentserve.models.arch.minicpm3 import MiniCPM3
from latentserve.models.arch.mistral4 import Mistral4
from latentserve.models.arch.mistral_large4 import MistralLarge4
from latentserve.models.arch.sarvam import SarvamMLA
from latentserve.models.arch.youtu import Youtu
from latentserve.models.fields import Fields

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    DeepseekV2(), DeepseekV3(), KimiK2(), SarvamMLA(), Glm4MoeLite(), Youtu(), AXK1(), MiniCPM3(), Mistral4(),
    LongcatFlash(), KimiK25(), DeepseekV32(), GlmMoeDsa(), AXK2(), HYV4(), HYV4VL(), KimiLinear(), BailingHybrid(),
    Glm5Next(), Dots3Note(), MistralLarge4(),
)}


def supported() -> list[str]:
    """One line per architecture: its model_type, the `architectures` names it loads, what it is."""
    return [f"{a.model_type}: {', '.join(a.architectures)} ({a.summary})" for a in ARCHITECTURES.values()]


def architecture_for(f: Fields) -> tuple[str, Architecture]:
    """(the architecture name config.json gives, its adapter), by `model_type` where the config has one (several
    families share an architecture name: sarvam_mla saves as DeepseekV3ForCausalLM), else by that name."""
    architectures = f.raw.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or not isinstance(architectures[0], str):
        raise ValueError(f"config.json: field 'architectures' must list one architecture, got {architectures!r}")
    name = architectures[0]
    model_type = f.raw.get("model_type")
    if model_type is None:
        by_name = [a for a in ARCHITECTURES.values() if name in a.architectures]
        if not by_name:
            raise ValueError(f"config.json: field 'architectures' names {name!r}; supported: {_names()}")
        return name, by_name[0]
    adapter = ARCHITECTURES.get(model_type)
    if adapter is None:
        raise ValueError(f"config.json: field 'model_type' is {model_type!r}; supported: {sorted(ARCHITECTURES)} "
                         f"({_names()})")
    if name not in adapter.architectures:
        raise ValueError(f"config.json: field 'architectures' names {name!r} but model_type {model_type!r} needs one "
                         f"of {list(adapter.architectures)}")
    return name, adapter


def _names() -> list[str]:
    return sorted(n for a in ARCHITECTURES.values() for n in a.architectures)
