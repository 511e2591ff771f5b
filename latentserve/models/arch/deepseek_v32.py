"""DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa): DeepSeek-V3 with DeepSeek Sparse Attention, a lightning
indexer picking each token's top-k positions (docs/dsa.md). V3.2 runs an indexer on every layer, with half-split
RoPE; GLM-5 only on its "full" layers, the "shared" ones reusing the last full layer's top-k, with interleaved RoPE.
Both list their dense and MoE layers as GLM-4.7-Flash does; the main attention always rotates interleaved pairs."""
from __future__ import annotations

from typing import Any

from latentserve.models.arch.base import Architecture, mlp_layer_types
from latentserve.models.dsa import DSAConfig
from latentserve.models.fields import Fields


class DeepseekV32(Architecture):
    model_type = "deepseek_v32"
    architectures = ("DeepseekV32ForCausalLM",)
    summary = "DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (an indexer on every layer)"
    index_n_heads = 64  # transformers' default
    interleaved_index_rope = False
    hidden_index_queries = False  # the indexers query from the layer's input, not q's LoRA residual

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        num_layers = parsed["num_hidden_layers"]
        if parsed["q_lora_rank"] is None and not self.hidden_index_queries:
            raise ValueError(f"{f.where}: field 'q_lora_rank' must be set: the DSA indexer reads q's LoRA residual")
        dsa = DSAConfig(index_topk=f.int("index_topk", 2048), index_n_heads=f.int("index_n_heads", self.index_n_heads),
                        index_head_dim=f.int("index_head_dim", 128), interleaved_rope=self.interleaved_index_rope,
                        indexer_layers=self.indexer_layers(f, num_layers), hidden_queries=self.hidden_index_queries)
        if dsa.index_head_dim < parsed["qk_rope_head_dim"]:
            raise ValueError(f"{f.where}: field 'index_head_dim' ({dsa.index_head_dim}) must be at least "
                             f"qk_rope_head_dim ({parsed['qk_rope_head_dim']}): the indexer rotates that many dims")
        return {"rope_style": "interleave", "mlp_bias": False, "dsa": dsa,
                "mlp_layer_types": mlp_layer_types(f, num_layers, first_dense=f.int("first_k_dense_replace", 3,
                                                                                    minimum=0))}

    def indexer_layers(self, f: Fields, num_layers: int) -> tuple[bool, ...]:
        return (True,) * num_layers


class GlmMoeDsa(DeepseekV32):
    model_type = "glm_moe_dsa"
    architectures = ("GlmMoeDsaForCausalLM",)
    summary = "GLM-5: DeepSeek Sparse Attention, later layers sharing an earlier layer's top-k"
    index_n_heads = 32
    interleaved_index_rope = True

    def indexer_layers(self, f: Fields, num_layers: int) -> tuple[bool, ...]:
        """`indexer_types` ("full" / "shared" per layer), else transformers' derivation from `index_topk_pattern`
        or `index_topk_freq` / `index_skip_topk_offset`."""
        types = f.raw.get("indexer_types")
        if types is None:
            pattern = f.raw.get("index_topk_pattern")
            if isinstance(pattern, str):
                types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
            elif pattern is not None:
                types = pattern
            else:
                freq = max(f.int("index_topk_freq", 1), 1)
                offset = f.int("index_skip_topk_offset", 2, minimum=0)
                types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
        if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"full", "shared"}:
            raise ValueError(f"{f.where}: field 'indexer_types' must list 'full' or 'shared' for each of the "
                             f"{num_layers} layers, got {types!r}")
        return tuple(t == "full" for t in types)
