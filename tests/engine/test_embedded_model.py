"""The embedded default model: latentserve and transformers agree on it."""
import torch

from latentserve import LLM, SamplingParams
from latentserve.assets import DEFAULT_MODEL_DIR
from tests.checkpoints import load_reference

PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd"]


def test_default_llm_matches_transformers_greedy():
    llm = LLM(max_num_seqs=4, num_kv_blocks=64, dtype="float32")  # no model: the embedded one
    assert llm.model_dir == DEFAULT_MODEL_DIR
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(PROMPTS, params)
    ref = load_reference(DEFAULT_MODEL_DIR)
    ref.generation_config.eos_token_id = None
    for out in outputs:
        prompt = out.prompt_token_ids
        with torch.no_grad():
            ref_logprobs = ref(torch.tensor([prompt])).logits[0].log_softmax(-1)
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        for pos in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref_logprobs[pos - 1, prompt[pos]].item()) <= 1e-4
        assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()
        assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)
