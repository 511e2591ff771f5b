"""Kimi-K2.5 (kimi_k25) against transformers: its DeepSeek-V3 text model (q LoRA, grouped sigmoid routing, YaRN)
inside the vision wrapper, text prompts only; the head tied to the embedding as the wrapper's default says."""
from dataclasses import dataclass

from tests.models.arch_harness import BASE, YARN, ArchCase, ArchSuite

VISION = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, pos_emb_height=4,
              pos_emb_width=4)


@dataclass(frozen=True)
class KimiCase(ArchCase):
    def transformers_config(self):
        from transformers import AutoConfig

        text = {**BASE, "model_type": "deepseek_v3", **self.config}
        text = {k: v for k, v in text.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
        config = AutoConfig.for_model("kimi_k25", text_config=text, vision_config=VISION, projection_hidden_size=16)
        config._attn_implementation = "eager"
        return config


class TestKimiK25(ArchSuite):
    case = KimiCase("kimi_k25", dict(q_lora_rank=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                                     routed_scaling_factor=2.5, rope_parameters=YARN),
                    model_class="Kimi_K25ForConditionalGeneration")


def test_published_names_load_the_same(tmp_path) -> None:
    """The published checkpoints name the text layers `layers` (transformers writes `blocks`) and may carry an
    MTP layer after them: the same model."""
    from safetensors.torch import load_file, save_file

    from latentserve.models.loader import SINGLE_FILE
    from tests.models.arch_harness import GREEDY, PROMPTS, llm, make_arch_checkpoint, prompt_logprobs

    path = make_arch_checkpoint(tmp_path, TestKimiK25.case)
    saved = llm(path).generate(PROMPTS, GREEDY)
    tensors = {name.replace("language_model.model.blocks.", "language_model.model.layers."): t
               for name, t in load_file(path / SINGLE_FILE).items()}
    tensors["language_model.model.layers.3.enorm.weight"] = tensors["language_model.model.norm.weight"].clone()
    save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})
    for a, b in zip(saved, llm(path).generate(PROMPTS, GREEDY)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and prompt_logprobs(a) == prompt_logprobs(b)
